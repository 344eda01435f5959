#!/usr/bin/env bash
# The GPU checks and measurements of a session with a lent GPU, as one prepared script:
#
#     bash benchmarks/gpu_session.sh OUT_DIR STEP [STEP ...]
#
# run from the repository root on the GPU machine (nothing is installed: the package runs
# from src/; wheels carried in .whl/, such as nemo-toolkit for the NeMo peers, are unpacked
# into a temporary site directory first). Each step writes <step>.log (and its JSON where
# it has one) into a work folder and runs under its own time limit, so that a slow step
# cannot eat the others' time; the last lines of every log are printed at the end. The
# work folder is packed into one file, OUT_DIR/session.tgz (the device tool brings back
# at most 8 files a call), when the script ends, also when an outer `timeout` stops it
# with SIGTERM (give that timeout `-k` a few seconds for the packing); unpack it here with
# `tar xzf session.tgz` (a folder session/). The results
# record the commit from RNNT_LATTICE_COMMIT when it is set: the device's copy of .git can
# lag behind the tree carried to it, so give the hash with the command, e.g.
#
#     RNNT_LATTICE_COMMIT=<git rev-parse --short HEAD, run here> bash benchmarks/gpu_session.sh ...
#
# Before the session, compile every kernel here with the device's Triton (3.6, older than
# the tests'): benchmarks/kernel_resources.py run from a venv with torch==2.13.0 and
# triton==3.6.0 exits 1 on a kernel that does not compile (docs/benchmarks.md, "The GPU
# machine's Triton (3.6) compiles every kernel").
#
#   check        rnnt-lattice check --device cuda (every kernel family against the float64
#                reference, no synchronisation, CUDA graph, memory, AMP recipe, bad input),
#                in CHECK_JOBS (8) worker processes: a first run is mostly Triton compiling
#                (150 s in one process on the last H200), which the workers do side by side
#                (with CUBLAS_WORKSPACE_CONFIG=:4096:8, so that the deterministic-mode check
#                runs the simple losses too: torch's rule for cuBLAS under the mode)
#   confident    benchmarks/confident_rows.py --device cuda: a confident model's float32
#                errors (12-20 nats) on the GPU, every topology whose read entries are formed
#                in float64 (regular, multi-blank's big blanks, TDT's durations, the simple
#                losses), the torch and Triton backends on CUDA tensors, and the joiner's
#                kernel path (its row sums' ties and its float64 entries)
#   passes       benchmarks/gpu_passes.py: each pass alone, the step, the host's enqueue
#                time, peak memory, torchaudio and NeMo's numba losses on the same logits
#                (regular, TDT, multi-blank), the lattice pass's lane sweep at s5, and a
#                profile of the host's time at s3
#   passes_base  the same passes at s5 (no peers) with the package in .ab/old/ (an earlier
#                commit's src/ and benchmarks/, carried), for an A/B on the same machine
#   tdt_sweep    the V passes' tile sweep at s5 and s5odd (V = 1025), regular and TDT: rows
#                read from their aligned span (the default) against a load per element
#   passes_ours  the same without the peers and the sweep (s3, s5, big)
#   joint_j1     the joiner's training step at j1 (32, 400, 100, 1024), H = 512, bf16
#                autocast: the full pipeline against the tile path (fused_rnnt_loss with the
#                model's own joiner: cuBLAS products, the V passes on each tile's logits)
#                and the joiner's kernel path
#   fused_tiles  the tile path's step at j1, H = 512, bf16, with tiles of 16, 32, 64 and 128
#                MiB of logits (the default is 256 MiB, joint_j1's): a tile that fits the
#                GPU's L2 (50 MiB on an H100) may be read back from there by the row and
#                gradient passes right after the joiner's product wrote it, at the cost of
#                more launches a step (about 160 tiles at 16 MiB)
#   joint_tiles  benchmarks/joint_tiles.py at j1, H = 512, bf16: the kernel path's block
#                choices (two or three programs a multiprocessor by a cap on registers,
#                maxnreg, and larger blocks that read less from L2), each against the default's bits with its row and gradient
#                passes timed apart (the fastest of each named), and its step by kernel
#   joint_tiles_tf32  the same sweep with float32 inputs and TF32 products, and float32's own
#                choices with more pipeline stages (joint_tiles.F32_CANDIDATES)
#   joint_tiles_tdt  joint_tiles.py for TDT at j4 (V = 8198 with durations 0..4), H = 640,
#                bf16: the capped blocks that joint.TILES took from the regular loss at j1,
#                against the others, for the duration head's wider rows
#   joint_tf32   the joiner's step at j1 with float32 inputs and TF32 products
#   joint_fp32   the joiner's step at j1 with float32 inputs and IEEE products (TF32 off,
#                PyTorch's default): the full pipeline, the tile path and a Joiner, which
#                takes the tile path there (gpu.joint.takes)
#   joint_tiles_fp32  joint_tiles.py at j1 with float32 inputs and IEEE products: the kernel
#                path forced (joint.IEEE_FLOAT32), to hold against joint_fp32's tile path
#   cuda_checks  tests/cuda_checks.py --big: the check at the benchmark shapes, offsets
#                past 2**31 (alone, after the others' CHECK_JOBS workers)
#   fused        benchmarks/run.py --device cuda --mode fused: the joiner's training step
#   pruned       benchmarks/run.py --device cuda --mode pruned at pg1, R = 5
#   pruned_profile  benchmarks/pruned_profile.py at pg1, R = 5: each stage of that step
#                timed alone, and the kernels with the most device time
#   pruned_det   the same under torch.use_deterministic_algorithms(True)
#                (CUBLAS_WORKSPACE_CONFIG=:4096:8): what the simple losses' ordered sums
#                cost, its backward stage against pruned_profile's
#   pruned_base  the same with the package in .ab/old/ (as passes_base), for an A/B of the
#                pruned step on the same machine
#   row_lanes    the row pass's reductions once a row (gpu.ROW_LANES, off by default until
#                timed) against every chunk, at s5 and big, regular / TDT / multi-blank: the
#                passes with the defaults, then at s5 the row pass's tiles with and without
#                (gpu_passes.py --sweep-configs: l / c), and the narrow gradient pass (TDT's
#                rows) on fewer warps: one row of 256 on 4 warps runs the row's
#                once-a-program work on every warp (n)
#   grad_rows    the gradient pass over rows that start anywhere: TDT at s5 and the regular
#                loss at s5odd (V = 1025), an entry a load on one row of 256 (e, the
#                default) against the row's whole 16-byte groups (g, gpu.SPAN_GRAD) on 16,
#                8 and 4 rows of 128 and 4 rows of 256; then the passes at s5 and big with
#                gpu.SPAN_GRAD on (gpu_passes.py --set), every topology
#   lattice_onchip  the lattice pass with its state in registers (gpu.LATTICE_ONCHIP, off
#                until timed): rnnt-lattice check --device cuda --quick with it on, then
#                gpu_passes.py --set LATTICE_ONCHIP=True at s3, s5 and big, every topology (the
#                defaults' passes: row_lanes or passes_ours in the same session)
#   switches     the three switches that are off until a GPU times them, at once (each acts
#                on its own pass: gpu.ROW_LANES the row pass, gpu.SPAN_GRAD the gradient
#                pass of rows that start anywhere, gpu.LATTICE_ONCHIP the lattice pass):
#                rnnt-lattice check --device cuda --quick with all three on, then
#                gpu_passes.py at s5 and big, every topology, with the defaults and with all
#                three on, twice in turn (switches-off1, -on1, -off2, -on2): at most 400 s
#   row_early    the V passes' three switches that are off until a GPU times them:
#                gpu.ROW_EARLY (the entries besides the token group's -- the blank's, the
#                label's, the fixed classes', the durations' -- read before the group's loop,
#                every topology) and gpu.SPAN_PREFETCH (the span's chunks loaded ahead: TDT's
#                rows, odd V) in the row pass, gpu.GRAD_DURATIONS_LAST (TDT's duration group
#                after the token group's loop) in the gradient pass: gpu_passes.py at s5 and
#                big, every topology, the defaults and all three on, in turn ROW_EARLY_RUNS
#                times (1: row_early-off1, -on1); then with
#                all three on, at s5 and s5odd (V = 1025), regular and TDT, the row pass on 16 and
#                8 rows of 128, 4 of 256 and 4 of 128 (row_early-sweep; the tiles today:
#                V_PASS_TILES["row"], 4 rows of 128, for aligned rows, 16 rows of 128 for the
#                span's; with both on, 8 rows of 128 keep 48 registers for aligned rows where
#                4 keep 40, so 10 programs of 4 KiB chunks a multiprocessor where 12 had 2 KiB)
#   joint_cublas the joiner's step at j1, H = 512, in bf16 and with TF32 products: the full
#                pipeline, the kernel path, and the kernel path with gpu.joint.CUBLAS_PRODUCTS
#                (each chunk's logits by cuBLAS and the V passes on them; off until timed),
#                interleaved, with their memory and agreement with the full pipeline
#   act_grad     joint_tiles.py --act-grad at j1, H = 512, bf16: the joiner's act-grad pass
#                alone on its first chunk with each choice of ACT_GRAD_CANDIDATES (the next
#                frame's loads ahead of the sums, blocks, warps, a cap on registers), against
#                the default's time, bandwidth and bits
#   timeline     benchmarks/timeline.py: where the device sits idle in a step, and whether it
#                waited for the host or between queued kernels, by the launch that came late:
#                the regular loss at s3 (host-bound) and s5, and the joiner's step at j1, H =
#                512, bf16, the kernel path, the full pipeline and the kernel path with its
#                chunks' logits by cuBLAS (timeline-*.log, .json, and the Chrome traces,
#                timeline-*.trace.json)
#   launch_ab    the launch path against Triton's own (RNNT_LATTICE_FAST_LAUNCH=1, 0, 1, 0):
#                gpu_passes.py at s3 and s5 (regular), then pruned_profile.py at pg1, each
#                run alternating, one log a run (launch_ab-<run>-fast<0|1>.log)
set -uo pipefail
dest="${1:?usage: gpu_session.sh OUT_DIR STEP...}"
shift
mkdir -p "$dest"
out="$(mktemp -d)/session"           # the steps' logs and results, packed at the end
mkdir -p "$out"
pack() { tar czf "$dest/session.tgz" -C "$(dirname "$out")" session && echo "packed $dest/session.tgz"; }
trap pack EXIT
trap 'exit 143' TERM INT             # EXIT's trap packs what the steps wrote so far
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton, numba; print('torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)"

run() {  # run STEP SECONDS COMMAND...
  local step=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$step.log" 2>&1
  echo "== $step: exit $? after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$out/$step.log"
}

ab() {  # ab NAME SECONDS RUNS "NAME=VALUE ...": gpu_passes.py at s5 and big, every topology,
        # the defaults (NAME-offI) and with the settings (NAME-onI) in turn, RUNS times
  local name=$1 limit=$2 runs=$3 settings=$4 i
  for i in $(seq "$runs"); do
    run "$name-off$i" "$limit" python3 benchmarks/gpu_passes.py \
      --shapes s5 big --variants regular tdt multiblank --peers --json "$out/$name-off$i.json"
    run "$name-on$i" "$limit" python3 benchmarks/gpu_passes.py --set $settings \
      --shapes s5 big --variants regular tdt multiblank --peers --json "$out/$name-on$i.json"
  done
}

for step in "$@"; do
  case "$step" in
    check) run check "${CHECK_LIMIT:-200}" env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
              python3 -m rnnt_lattice check --device cuda --jobs "${CHECK_JOBS:-8}" \
              --json "$out/check.json" ;;
    confident) run confident "${CONFIDENT_LIMIT:-90}" python3 benchmarks/confident_rows.py \
              --device cuda --topologies regular multiblank tdt simple smoothed ;;
    passes) run passes "${PASSES_LIMIT:-170}" python3 benchmarks/gpu_passes.py \
              --shapes s3 s5 big v5000 --variants regular tdt multiblank \
              --peers torchaudio nemo_numba nemo_tdt nemo_multiblank --lattice-sweep s5 \
              --host-profile s3 --json "$out/passes.json" ;;
    passes_base) run passes_base "${PASSES_BASE_LIMIT:-60}" env PYTHONPATH="$PWD/.ab/old/src:$PWD/.ab/old/benchmarks:/tmp/site" \
              python3 .ab/old/benchmarks/gpu_passes.py --shapes s5 \
              --variants regular tdt multiblank --peers --json "$out/passes_base.json" ;;
    tdt_sweep) run tdt_sweep "${SWEEP_LIMIT:-150}" python3 benchmarks/gpu_passes.py \
              --shapes s5 s5odd --variants regular tdt --peers --sweep s5 s5odd \
              --json "$out/tdt_sweep.json" ;;
    passes_ours) run passes_ours "${PASSES_OURS_LIMIT:-90}" python3 benchmarks/gpu_passes.py --shapes s3 s5 big \
              --variants regular tdt multiblank --peers --json "$out/passes_ours.json" ;;
    joint_j1) run joint_j1 "${JOINT_J1_LIMIT:-100}" python3 benchmarks/run.py --device cuda --mode fused --shapes j1 \
              --hidden 512 --ways full fused joint --precision bf16 --reps 3 --warmup 1 \
              --out-dir "$out" --stem cuda-joint-j1-bf16 ;;
    fused_tiles) for t in 16MiB 32MiB 64MiB 128MiB; do
                run "fused_tiles-$t" "${FUSED_TILES_LIMIT:-60}" python3 benchmarks/run.py --device cuda \
                  --mode fused --shapes j1 --hidden 512 --ways fused --precision bf16 --reps 3 \
                  --warmup 1 --tile "$t" --out-dir "$out" --stem "cuda-fused-j1-bf16-$t"
              done ;;
    joint_tiles) run joint_tiles "${JOINT_TILES_LIMIT:-150}" python3 benchmarks/joint_tiles.py \
              --shape j1 --hidden 512 --precision bf16 --reps 3 --json "$out/joint_tiles.json" ;;
    joint_tiles_tf32) run joint_tiles_tf32 "${JOINT_TILES_TF32_LIMIT:-210}" python3 benchmarks/joint_tiles.py \
              --shape j1 --hidden 512 --precision tf32 --reps 3 --json "$out/joint_tiles_tf32.json" ;;
    joint_tiles_tdt) run joint_tiles_tdt "${JOINT_TILES_TDT_LIMIT:-150}" python3 benchmarks/joint_tiles.py \
              --shape j4 --hidden 640 --loss tdt --precision bf16 --reps 3 \
              --json "$out/joint_tiles_tdt.json" ;;
    joint_tf32) run joint_tf32 "${JOINT_TF32_LIMIT:-90}" python3 benchmarks/run.py --device cuda --mode fused --shapes j1 \
              --hidden 512 --ways full joint --precision tf32 --reps 3 --warmup 1 \
              --out-dir "$out" --stem cuda-joint-j1-tf32 ;;
    joint_fp32) run joint_fp32 "${JOINT_FP32_LIMIT:-90}" python3 benchmarks/run.py --device cuda --mode fused --shapes j1 \
              --hidden 512 --ways full fused joint --precision fp32 --reps 3 --warmup 1 \
              --out-dir "$out" --stem cuda-joint-j1-fp32 ;;
    joint_tiles_fp32) run joint_tiles_fp32 "${JOINT_TILES_FP32_LIMIT:-150}" python3 benchmarks/joint_tiles.py \
              --shape j1 --hidden 512 --precision fp32 --reps 1 --json "$out/joint_tiles_fp32.json" ;;
    cuda_checks) run cuda_checks "${CUDA_CHECKS_LIMIT:-200}" python3 tests/cuda_checks.py --big \
              --jobs "${CHECK_JOBS:-8}" ;;
    fused) run fused 150 python3 benchmarks/run.py --device cuda --mode fused --out-dir "$out" ;;
    pruned) run pruned "${PRUNED_LIMIT:-90}" python3 benchmarks/run.py --device cuda --mode pruned --shapes pg1 \
              --windows 5 --reps 5 --out-dir "$out" ;;
    pruned_profile) run pruned_profile "${PRUNED_PROFILE_LIMIT:-90}" python3 \
              benchmarks/pruned_profile.py --device cuda --shape pg1 --window 5 --reps 5 \
              --json "$out/pruned_profile.json" ;;
    pruned_det) run pruned_det "${PRUNED_DET_LIMIT:-90}" env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
              python3 benchmarks/pruned_profile.py --device cuda --shape pg1 --window 5 \
              --reps 5 --deterministic --json "$out/pruned_det.json" ;;
    pruned_base) run pruned_base "${PRUNED_PROFILE_LIMIT:-90}" env \
              PYTHONPATH="$PWD/.ab/old/src:$PWD/.ab/old/benchmarks:/tmp/site" python3 \
              .ab/old/benchmarks/pruned_profile.py --device cuda --shape pg1 --window 5 --reps 5 \
              --json "$out/pruned_base.json" ;;
    row_lanes) run row_lanes "${ROW_LANES_LIMIT:-220}" python3 benchmarks/gpu_passes.py \
              --shapes s5 big --variants regular tdt multiblank --peers --sweep s5 \
              --sweep-configs 4x128x4c 4x128x4l 8x128x4l 4x256x4l 16x128x4c 16x128x4l \
              8x256x4l 1x256x4n 1x256x2n 1x256x1n 1x512x2n 2x256x2n \
              --json "$out/row_lanes.json" ;;
    grad_rows) for v in "tdt s5" "regular s5odd"; do
                read -r variant shape <<<"$v"
                run "grad_rows-$variant" "${GRAD_ROWS_LIMIT:-90}" python3 benchmarks/gpu_passes.py \
                  --shapes "$shape" --variants "$variant" --peers --sweep "$shape" \
                  --sweep-configs 1x256x4e 16x128x4g 8x128x4g 4x128x4g 4x256x4g \
                  --json "$out/grad_rows-$variant.json"
              done
              run grad_rows-on "${GRAD_ROWS_LIMIT:-90}" python3 benchmarks/gpu_passes.py \
                --set SPAN_GRAD=True --shapes s5 big --variants regular tdt multiblank --peers \
                --json "$out/grad_rows-on.json" ;;
    lattice_onchip) run lattice_onchip-check "${ONCHIP_CHECK_LIMIT:-120}" python3 -c \
                "import sys; from rnnt_lattice import gpu, cli; gpu.LATTICE_ONCHIP = True; sys.exit(cli.main(['check', '--device', 'cuda', '--quick']))"
              run lattice_onchip "${ONCHIP_LIMIT:-90}" python3 benchmarks/gpu_passes.py \
                --set LATTICE_ONCHIP=True --shapes s3 s5 big --variants regular tdt multiblank \
                --peers --json "$out/lattice_onchip.json" ;;
    switches) on="ROW_LANES=True SPAN_GRAD=True LATTICE_ONCHIP=True"
              run switches-check "${SWITCHES_CHECK_LIMIT:-120}" python3 -c \
                "import sys; from rnnt_lattice import gpu, cli; gpu.ROW_LANES = gpu.SPAN_GRAD = gpu.LATTICE_ONCHIP = True; sys.exit(cli.main(['check', '--device', 'cuda', '--quick']))"
              ab switches "${SWITCHES_LIMIT:-70}" 2 "$on" ;;
    row_early) on="ROW_EARLY=True SPAN_PREFETCH=True GRAD_DURATIONS_LAST=True"
              # 90 s a run: on the H200 the first gpu_passes.py run after check (switches-off1)
              # ran out of a 70 s limit, compiling its kernels
              ab row_early "${ROW_EARLY_LIMIT:-90}" "${ROW_EARLY_RUNS:-1}" "$on"
              run row_early-sweep "${ROW_EARLY_SWEEP_LIMIT:-100}" python3 benchmarks/gpu_passes.py \
                --set $on --shapes s5 s5odd --variants regular tdt --peers --sweep s5 s5odd \
                --sweep-configs 16x128x4 8x128x4 4x256x4 4x128x4 \
                --json "$out/row_early-sweep.json" ;;
    joint_cublas) for prec in bf16 tf32; do
                run "joint_cublas-$prec" "${JOINT_CUBLAS_LIMIT:-100}" python3 benchmarks/run.py --device cuda \
                  --mode fused --shapes j1 --hidden 512 --ways full joint joint_cublas \
                  --precision "$prec" --reps 3 --warmup 1 --out-dir "$out" --stem "cuda-joint-cublas-j1-$prec"
              done ;;
    act_grad) run act_grad "${ACT_GRAD_LIMIT:-90}" python3 benchmarks/joint_tiles.py --act-grad \
              --shape j1 --hidden 512 --reps 20 --json "$out/act_grad.json" ;;
    timeline) for spec in "s3:--loss s3" "s5:--loss s5" "j1-joint:--joint j1 --way joint" \
                          "j1-full:--joint j1 --way full" "j1-cublas:--joint j1 --way joint_cublas"; do
                name=${spec%%:*}
                run "timeline-$name" "${TIMELINE_LIMIT:-90}" python3 benchmarks/timeline.py ${spec#*:} \
                  --json "$out/timeline-$name.json" --trace "$out/timeline-$name.trace.json"
              done ;;
    launch_ab) i=0
              for m in 1 0 1 0; do
                i=$((i + 1))
                run "launch_ab-passes$i-fast$m" "${LAUNCH_AB_LIMIT:-45}" env RNNT_LATTICE_FAST_LAUNCH=$m \
                  python3 benchmarks/gpu_passes.py --shapes s3 s5 --variants regular --peers
              done
              for m in 1 0 1 0; do
                i=$((i + 1))
                run "launch_ab-pruned$i-fast$m" "${LAUNCH_AB_LIMIT:-45}" env RNNT_LATTICE_FAST_LAUNCH=$m \
                  python3 benchmarks/pruned_profile.py --device cuda --shape pg1 --window 5 --reps 5
              done ;;
    *) echo "unknown step $step" ;;
  esac
done

for log in "$out"/*.log; do
  echo "---- $(basename "$log" .log)"
  grep -E "FAIL|RESULT|checks:|Error|error|exit" "$log" | tail -n 12 | cut -c1-300
done
