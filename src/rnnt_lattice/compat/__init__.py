"""Drop-in modules for the peers' users: the same names, argument conventions and return
values, computed by rnnt_lattice's kernels. One module per peer; a user switches by
changing one import (docs/migrating.md):

- ``rnnt_lattice.compat.k2``: k2 and fast_rnnt (icefall);
- ``rnnt_lattice.compat.torchaudio``: ``torchaudio.functional.rnnt_loss`` and
  ``torchaudio.transforms.RNNTLoss``;
- ``rnnt_lattice.compat.nemo``: NeMo's numba RNN-T, TDT and multi-blank losses, and
  ``install()`` for NeMo's own ``RNNTLoss``;
- ``rnnt_lattice.compat.warprnnt_numba``: warprnnt-numba (NeMo's RNN-T loss, packaged alone);
- ``rnnt_lattice.compat.warp_rnnt``: warp-rnnt;
- ``rnnt_lattice.compat.warp_transducer``: warp-transducer's ``warprnnt_pytorch``;
- ``rnnt_lattice.compat.optimized_transducer``: optimized_transducer;
- ``rnnt_lattice.compat.speechbrain``: SpeechBrain's transducer loss;
- ``rnnt_lattice.compat.transformers``: Hugging Face transformers' Parakeet TDT and RNN-T
  losses, ``install()`` for its models and ``fuse(model)``, the fused joint and loss.

The frameworks that call a loss for their users switch with one line, without an edit to
the framework: ``compat.transformers.install()``, ``compat.warp_transducer.install()``
(ESPnet's ``import warprnnt_pytorch``), ``compat.torchaudio.install()`` (code that calls
``torchaudio.functional.rnnt_loss``) and ``compat.nemo.install()``.

Importing ``rnnt_lattice.compat`` imports none of them (each loads on its own import).
"""
