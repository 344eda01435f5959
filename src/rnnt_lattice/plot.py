"""Pictures of the lattice: node occupancy as a heat map with the best path drawn over it.

Matplotlib is the optional extra ``plot`` (``pip install matplotlib``) and is
imported inside the functions. Figures are built with ``matplotlib.figure.Figure`` (no
pyplot, no global state, no window): nothing here ever calls ``show()``; save with
:func:`save` (or ``fig.savefig``) or display the returned figure in a notebook.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

__all__ = ["plot_occupancy", "save"]

DEFAULT_FIGSIZE = (6.4, 3.6)   # inches; at the default dpi=100 a saved PNG is 640 x 360 pixels
DEFAULT_DPI = 100


def _mpl():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as err:   # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            "rnnt_lattice.plot needs matplotlib (the package's extra 'plot'): "
            "pip install matplotlib") from err
    return matplotlib, Figure


def plot_occupancy(occ, index: int = 0, alignment=None, labels: Sequence[str] | None = None,
                   *, ax=None, title: str | None = None, cmap: str = "viridis",
                   figsize=DEFAULT_FIGSIZE, dpi: int = DEFAULT_DPI):
    """Heat map of ``occ.node[index]`` (frames on x, label positions on y) with the best
    path of ``alignment`` drawn over it, for any topology (``occupancy`` /
    ``best_alignment`` with ``rnnt_type`` or ``topology=``).

    The path is one polyline through the nodes its arcs leave (``alignment.path(index)``),
    so each arc is one segment: a regular label arc goes up, a blank one frame right, a
    modified/constrained label diagonally, and an arc of ``dt > 1`` frames (a TDT duration,
    a big blank) is a longer segment. The last arc, into the virtual end frame ``T_b``, is
    not drawn.

    Example::

        >>> import torch, rnnt_lattice
        >>> from rnnt_lattice.plot import plot_occupancy, save
        >>> logits = torch.randn(1, 12, 4, 6)                        # (B, T, U+1, V)
        >>> args = (logits, torch.tensor([[1, 2, 3]]), torch.tensor([12]), torch.tensor([3]))
        >>> occ = rnnt_lattice.occupancy(*args, blank=0)
        >>> ali = rnnt_lattice.best_alignment(*args, blank=0)
        >>> fig, ax = plot_occupancy(occ, 0, ali, labels=["a", "b", "c"])
        >>> # save(fig, "lattice.png")  # or .svg
        >>> from rnnt_lattice import topology
        >>> x = torch.randn(1, 12, 4, 6 + 3)                         # 6 tokens (blank last), 3 durations
        >>> kw = dict(blank=-1, topology=topology.tdt([0, 1, 2]), backend="torch")
        >>> occ = rnnt_lattice.occupancy(x, *args[1:], **kw)
        >>> fig, ax = plot_occupancy(occ, 0, rnnt_lattice.best_alignment(x, *args[1:], **kw))

    Args:
        occ: an :class:`rnnt_lattice.Occupancy` (``node`` is ``(B, T, U+1)``) of any topology.
        index: which sequence of the batch.
        alignment: an :class:`rnnt_lattice.Alignment` of the same batch, or None.
        labels: ``U_b`` strings, the target tokens; row ``u`` is ticked with the label
            emitted on entering it (``labels[u-1]``; row 0 is the start, ``∅``).
        ax: draw into this Axes (its figure is returned) instead of a new figure.
        title, cmap, figsize (inches), dpi: figure options.

    Returns:
        ``(fig, ax)``: the matplotlib Figure and Axes.
    """
    _, Figure = _mpl()
    from ._validate import check_int
    from .analysis import Alignment, Occupancy
    if not isinstance(occ, Occupancy):
        raise ValueError(f"occ must be an rnnt_lattice.Occupancy (rnnt_lattice.occupancy's "
                         f"result), got {type(occ).__name__}")
    if alignment is not None and not isinstance(alignment, Alignment):
        raise ValueError(f"alignment must be an rnnt_lattice.Alignment (rnnt_lattice."
                         f"best_alignment's result) or None, got {type(alignment).__name__}")
    index = check_int("index", index)
    if not 0 <= index < occ.node.shape[0]:
        raise ValueError(f"index={index} is outside the batch of size {occ.node.shape[0]}")
    T_b, U_b = int(occ.logit_lengths[index]), int(occ.target_lengths[index])
    if alignment is not None:
        B_a, B_o = alignment.log_prob.shape[0], occ.log_likelihood.shape[0]
        dims = (int(alignment.logit_lengths[index]), int(alignment.target_lengths[index])
                ) if B_a == B_o else None
        if dims != (T_b, U_b):
            raise ValueError("alignment is not of occ's batch: " + (
                f"B = {B_a} there, {B_o} in occ" if dims is None else
                f"sequence {index} has (T_b, U_b) = {dims} there, {(T_b, U_b)} in occ"))
    if T_b == 0:
        raise ValueError(f"sequence {index} has no frames (T_b = 0): nothing to draw")
    if labels is not None and not (hasattr(labels, "__len__") and hasattr(labels, "__iter__")):
        raise ValueError(f"labels must be a sequence of U_b = {U_b} strings or None, got "
                         f"{type(labels).__name__}")
    if labels is not None and len(labels) != U_b:
        raise ValueError(f"labels has {len(labels)} entries but sequence {index} has U_b = {U_b} labels")
    if ax is not None:
        from matplotlib.axes import Axes
        if not isinstance(ax, Axes):
            raise ValueError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    node = occ.node[index, :T_b, :U_b + 1].detach().to("cpu", torch.float64).numpy()

    if ax is None:
        fig = Figure(figsize=figsize, dpi=dpi)
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    im = ax.imshow(node.T, origin="lower", aspect="auto", cmap=cmap, vmin=0.0, vmax=1.0,
                   interpolation="nearest", extent=(-0.5, T_b - 0.5, -0.5, U_b + 0.5))
    fig.colorbar(im, ax=ax, label="node occupancy")
    if alignment is not None:
        path = alignment.path(index)
        if path:
            ts, us = zip(*path)
            ax.plot(ts, us, color="white", linewidth=1.5, marker="o", markersize=2.5,
                    label="best path")
            ax.legend(loc="lower right", fontsize="small", framealpha=0.6)
    ax.set_xlabel("frame t")
    ax.set_ylabel("label position u")
    if labels is not None and U_b <= 60:
        ax.set_yticks(range(U_b + 1))
        ax.set_yticklabels(["∅"] + [str(x) for x in labels])
    ax.set_xlim(-0.5, T_b - 0.5)
    ax.set_ylim(-0.5, U_b + 0.5)
    if title is not None:
        ax.set_title(title)
    fig.tight_layout()
    return fig, ax


def save(fig, path: str | os.PathLike, dpi: int | None = None) -> None:
    """Save ``fig`` as PNG or SVG (from the file extension) with the Agg/SVG renderers;
    never opens a window."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in (".png", ".svg"):
        raise ValueError(f"path must end in .png or .svg, got {str(path)!r}")
    _, Figure = _mpl()
    if not isinstance(fig, Figure):
        raise ValueError(f"fig must be a matplotlib Figure (plot_occupancy returns (fig, ax): "
                         f"save(fig, path)), got {type(fig).__name__}")
    if dpi is not None and not (isinstance(dpi, str) and dpi == "figure"):   # (matplotlib's)
        from ._validate import check_float
        dpi = check_float("dpi", dpi, finite=True)
        if dpi <= 0:
            raise ValueError(f"dpi must be > 0, got {dpi}")
    fig.savefig(path, dpi=dpi if dpi is not None else fig.dpi)
