"""One figure style for the whole workbench, and deterministic PDF + PNG export into figures/.

Column-width figures (3.4 in), seaborn "ticks" theme, the colour-blind-safe palette, TrueType fonts
embedded in PDFs (pdf.fonttype 42) so that journals accept them, PNG at 300 dpi.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from moelab.results import REPO, atomic_write_bytes

COLUMN_WIDTH_IN = 3.4
FULL_WIDTH_IN = 7.0
PALETTE = "colorblind"
# one colour per routing policy, used by every notebook
POLICY_COLORS = {
    "TopK": "#0173B2",
    "EntropyAdaptiveK": "#DE8F05",
    "TopP": "#029E73",
    "RatioSkip": "#D55E00",
    "native": "#000000",
}


def setup_style() -> None:
    """Apply the workbench style (idempotent)."""
    import seaborn as sns

    sns.set_theme(context="paper", style="ticks", palette=PALETTE, font_scale=1.0)
    matplotlib.rcParams.update(
        {
            "pdf.fonttype": 42,
            "ps.fonttype": 42,
            "figure.dpi": 110,
            "savefig.dpi": 300,
            "savefig.bbox": "tight",
            "figure.figsize": (COLUMN_WIDTH_IN, COLUMN_WIDTH_IN * 0.75),
            "axes.titlesize": 9,
            "axes.labelsize": 8,
            "xtick.labelsize": 7,
            "ytick.labelsize": 7,
            "legend.fontsize": 7,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )


def figures_dir() -> Path:
    """figures/ of the repository (MOELAB_FIGURES overrides)."""
    return Path(os.environ.get("MOELAB_FIGURES", REPO / "figures"))


def figure(width: str | float = "column", aspect: float = 0.75, **kw):
    """A new styled figure: width 'column' (3.4 in), 'full' (7 in) or inches.

    Constrained layout unless `layout=` says otherwise, so a suptitle or an outside legend never overlaps
    the panels' titles and labels.
    """
    w = {"column": COLUMN_WIDTH_IN, "full": FULL_WIDTH_IN}.get(width, width) if isinstance(width, str) else width
    if isinstance(w, (str, bool)) or not isinstance(w, (int, float)) or not 0 < w < 100:
        raise ValueError(f"width={width!r}: must be 'column', 'full' or a width in inches (0 < w < 100)")
    setup_style()
    kw.setdefault("layout", "constrained")
    return plt.subplots(figsize=(w, w * aspect), **kw)


def _check_stem(name: str, what: str, example: str, exts: tuple[str, ...]) -> None:
    """A file stem inside figures/: no folder part (no '/', '\\' or '..'), no extension of its own."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or name.endswith(exts):
        raise ValueError(f"{what} name {name!r}: give a plain stem such as {example!r} (written into figures/)")


def savefig(fig, name: str) -> dict:
    """Save `fig` as figures/<name>.pdf and .png (300 dpi); returns the two paths."""
    _check_stem(name, "figure", "02_pareto_tiny-olmoe", (".pdf", ".png"))
    import io

    out = {}
    for ext in ("pdf", "png"):
        buf = io.BytesIO()
        # fixed metadata: the same figure gives the same bytes, run after run
        meta = {"CreationDate": None} if ext == "pdf" else {"Software": None}
        fig.savefig(buf, format=ext, metadata=meta)
        path = figures_dir() / f"{name}.{ext}"
        atomic_write_bytes(path, buf.getvalue())
        out[ext] = path
    return out


def save_table(df, name: str, caption: str = "", float_format: str = "{:.3g}") -> dict:
    """Export a table as figures/<name>.csv and figures/<name>.tex (booktabs)."""
    _check_stem(name, "table", "05_paper_table", (".csv", ".tex"))
    d = figures_dir()
    csv = df.to_csv(index=False).encode()
    atomic_write_bytes(d / f"{name}.csv", csv)
    body = df.to_latex(index=False, float_format=lambda v: float_format.format(v), escape=True)
    tex = body if not caption else f"% {caption}\n{body}"
    atomic_write_bytes(d / f"{name}.tex", (tex + "\n").encode())
    return {"csv": d / f"{name}.csv", "tex": d / f"{name}.tex"}


def policy_color(label: str, kind: str) -> str:
    """A policy's colour: black for the native top-k, else its kind's (POLICY_COLORS)."""
    return POLICY_COLORS["native"] if re.search(r"\bnative\b", label) else POLICY_COLORS.get(kind, "grey")


def plot_policy_stats(stats, title: str, native_k: int):
    """Two panels from `compute.policy_stats` / `pool_layers` rows: the share of tokens per kept k, and the
    routed-expert FLOPs saved against the native k (with the whole-forward saving where a row has one)."""
    import numpy as np

    fig, (ax_h, ax_r) = figure("full", aspect=0.36, ncols=2, layout="constrained",
                              gridspec_kw={"width_ratios": [1.3, 1]})  # room for the two-line y labels
    k_max = max(len(h) for h in stats.k_hist) - 1
    ks = np.arange(1, k_max + 1)  # every policy keeps at least one expert
    width = 0.8 / len(stats)
    for i, row in enumerate(stats.itertuples()):
        share = np.zeros(k_max + 1)
        share[: len(row.k_hist)] = np.asarray(row.k_hist) / max(row.tokens, 1)
        ax_h.bar(ks + (i - (len(stats) - 1) / 2) * width, share[1:], width,
                 label=row.policy, color=policy_color(row.policy, row.kind))
    ax_h.set(xlabel="experts kept per token (k)", ylabel="share of tokens", xticks=ks)
    ax_h.legend(frameon=False, fontsize=6, ncol=3, loc="upper left", bbox_to_anchor=(0.0, -0.22))
    y = np.arange(len(stats))
    ax_r.barh(y, 100 * stats.expert_reduction, color=[policy_color(r.policy, r.kind) for r in stats.itertuples()])
    labels = [f"mean k {m:.2f}" for m in stats.mean_k]
    if "forward_reduction" in stats:  # whole-forward FLOPs saved, from the model's shapes
        labels = [f"{lb}\nforward saved {100 * f:.1f}%" if np.isfinite(f) else lb
                  for lb, f in zip(labels, stats.forward_reduction)]
    ax_r.set(yticks=y, yticklabels=labels, xlabel=f"routed-expert FLOPs saved vs native k={native_k} (%)")
    ax_r.axvline(0, color="black", lw=0.6)
    ax_r.invert_yaxis()
    ax_r.tick_params(axis="y", labelsize=6)
    fig.suptitle(title, fontsize=9)
    return fig


def explorer(render, **controls):
    """ipywidgets `controls` above an Output showing render(**their values), redrawn when one changes; render
    returns what to show (a figure, which is then closed, or a frame).

    The Output is filled kernel-side (append_display_data), never by capturing display() in it (`with out:`, what
    widgets.interactive does): a headless executor (papermill, nbconvert) mimics a capturing Output by sending the
    kernel messages mid-cell, which can hang the run for good (nbclient issue 312)."""
    import ipywidgets as widgets

    out = widgets.Output()

    def update(change=None):
        shown = render(**{name: c.value for name, c in controls.items()})
        out.outputs = ()
        out.append_display_data(shown)
        if isinstance(shown, matplotlib.figure.Figure):
            plt.close(shown)

    for c in controls.values():
        c.observe(update, names="value")
    update()
    return widgets.VBox([*controls.values(), out])
