"""Draw the site's figures as SVG (stdlib only): ``python docs/_figures/make_figures.py``.

The figures are committed under ``docs/assets/figures/``; rerun this after editing it. Each figure
is computed from the same rules as the code it illustrates (rank = dp_coord * sp + sp_coord, chunk
``j`` of the head dim goes to sp rank ``j``, ``du.kv_head_index`` for GQA), not drawn by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "assets" / "figures"
FONT = "font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"
# one colour per sp rank / head group (colour-blind-friendly palette)
COLORS = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#000000"]


class Svg:
    def __init__(self, width: int, height: int, title: str) -> None:
        self.w, self.h = width, height
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{title}">',
            f"<title>{title}</title>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            'fill="#444"/></marker></defs>',
        ]

    def rect(self, x, y, w, h, fill, stroke="#333", sw=1, rx=0, opacity=1.0):
        self.parts.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="{rx}" fill="{fill}" '
            f'fill-opacity="{opacity}" stroke="{stroke}" stroke-width="{sw}"/>'
        )

    def text(self, x, y, s, size=12, anchor="middle", weight="normal", fill="#222"):
        s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        self.parts.append(
            f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}" style="{FONT}">{s}</text>'
        )

    def line(self, x1, y1, x2, y2, arrow=True, color="#444", sw=1.2, dash=""):
        extra = ' marker-end="url(#arrow)"' if arrow else ""
        dash = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" '
            f'stroke-width="{sw}"{dash}{extra}/>'
        )

    def save(self, name: str) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / name).write_text("\n".join([*self.parts, "</svg>", ""]), encoding="utf-8")


def all_to_all(P: int = 4, N: int = 8) -> None:
    """q[B, S_sp, N, H] -> q[B, S, N_sp, H] on P sp ranks: who holds which tokens and heads."""
    n = N // P
    cw, ch = 22, 22  # cell: one head x one sequence chunk
    gap = 18
    left_w = N * cw
    right_w = n * cw
    top = 84
    box_h_left = ch + 26
    box_h_right = P * ch + 26
    row_h = box_h_right + gap
    x_left, x_right = 120, 120 + left_w + 300
    width = x_right + right_w + 150
    height = top + P * row_h + 70
    svg = Svg(width, height, "Ulysses all-to-all: sequence-sharded to head-sharded")
    svg.text(x_left + left_w / 2, 24, "before: q[B, S_sp, N, H]", 15, weight="bold")
    svg.text(x_left + left_w / 2, 44, "sp placement Shard(1): a slice of tokens, all heads", 12)
    svg.text(x_right + right_w / 2, 24, "inside attention: q[B, S, N_sp, H]", 15, weight="bold")
    svg.text(x_right + right_w / 2, 44, "sp placement Shard(2): all tokens, a slice of heads", 12)
    mid = (x_left + left_w + x_right) / 2
    svg.text(mid, 72, "one all-to-all on the sp group", 13, weight="bold", fill="#444")
    for r in range(P):
        y = top + r * row_h
        # left: rank r holds tokens chunk r, every head; colour = the rank the head goes to
        svg.text(x_left - 12, y + 30, f"sp rank {r}", 12, anchor="end", weight="bold")
        svg.rect(x_left - 4, y, left_w + 8, box_h_left, "#f6f6f6", "#999", rx=6)
        for h in range(N):
            dest = h // n
            svg.rect(x_left + h * cw, y + 16, cw, ch, COLORS[dest], "#fff", opacity=0.85)
            svg.text(x_left + h * cw + cw / 2, y + 31, f"s{r}", 9, fill="#fff")
        svg.text(x_left + left_w / 2, y + 12, f"slice s{r} of S, heads 0..{N - 1}", 10)
        # right: rank r holds every tokens chunk for its heads
        svg.rect(x_right - 4, y, right_w + 8, box_h_right, "#f6f6f6", "#999", rx=6)
        svg.text(x_right + right_w + 14, y + 30, f"sp rank {r}", 12, anchor="start", weight="bold")
        svg.text(
            x_right + right_w + 14, y + 46, f"heads {r * n}..{r * n + n - 1}", 10, anchor="start"
        )
        for src in range(P):
            for h in range(n):
                svg.rect(
                    x_right + h * cw, y + 16 + src * ch, cw, ch, COLORS[r], "#fff", opacity=0.85
                )
                svg.text(x_right + h * cw + cw / 2, y + 31 + src * ch, f"s{src}", 9, fill="#fff")
        svg.text(x_right + right_w / 2, y + 12, "all S", 10)
    # arrows: chunk dest of rank src -> rank dest
    for src in range(P):
        for dest in range(P):
            y1 = top + src * row_h + 16 + ch / 2
            y2 = top + dest * row_h + 16 + src * ch + ch / 2
            svg.line(
                x_left + left_w + 8, y1, x_right - 10, y2, color=COLORS[dest], sw=1.1,
                dash="" if src == dest else "4 3",
            )  # fmt: skip
    notes = [
        f"P={P} sp ranks, N={N} heads. Colour: the sp rank that holds the head after the exchange;",
        f"s0..s{P - 1}: the tokens of sequence slice 0..{P - 1}. Each rank keeps 1/P of its data "
        "and sends 1/P to every other rank (dashed).",
        "The return trip, o[B, S, N_sp, H] -> o[B, S_sp, N, H], is the mirror image.",
    ]
    for i, note in enumerate(notes):
        svg.text(width / 2, height - 50 + 17 * i, note, 11)
    svg.save("all-to-all.svg")


def mesh(dp: int = 2, sp: int = 4) -> None:
    """The ("dp", "sp") mesh: rank = dp_coord * sp + sp_coord; sp groups are rows."""
    cw, ch = 96, 52
    x0, y0 = 130, 70
    width = x0 + sp * cw + 220
    height = y0 + dp * ch + 110
    svg = Svg(width, height, f"DeviceMesh of shape (dp={dp}, sp={sp})")
    svg.text(width / 2, 24, f'init_mesh(dp={dp}, sp={sp}): mesh_dim_names=("dp", "sp")', 15,
             weight="bold")  # fmt: skip
    for s in range(sp):
        svg.text(x0 + s * cw + cw / 2, y0 - 10, f"sp coord {s}", 11)
    for d in range(dp):
        y = y0 + d * ch
        svg.text(x0 - 14, y + ch / 2 + 4, f"dp coord {d}", 11, anchor="end")
        svg.rect(x0 - 6, y + 4, sp * cw + 12, ch - 8, "none", COLORS[d], sw=2.5, rx=10)
        for s in range(sp):
            rank = d * sp + s
            svg.rect(x0 + s * cw + 6, y + 10, cw - 12, ch - 20, "#ffffff", "#555", rx=4)
            svg.text(x0 + s * cw + cw / 2, y + ch / 2 + 4, f"rank {rank}", 12, weight="bold")
        svg.text(x0 + sp * cw + 16, y + ch / 2 - 2, f'sp group {d}: mesh["sp"]', 11,
                 anchor="start", fill=COLORS[d])  # fmt: skip
        svg.text(x0 + sp * cw + 16, y + ch / 2 + 12, "one sequence, sliced", 10, anchor="start",
                 fill=COLORS[d])  # fmt: skip
    for s in range(sp):
        x = x0 + s * cw + cw / 2
        svg.line(x, y0 + 6, x, y0 + dp * ch - 6, arrow=False, color="#888", sw=1, dash="3 3")
    yb = y0 + dp * ch
    svg.text(x0 + sp * cw / 2, yb + 18, 'columns: dp groups (mesh["dp"]): different sequences, '
             "same token positions", 11)  # fmt: skip
    svg.text(x0 + sp * cw / 2, yb + 40, f'flatten_dp_sp(mesh): one group of all {dp * sp} ranks '
             "(ranks 0..{}) over which FSDP2 shards parameters".format(dp * sp - 1), 11,
             weight="bold")  # fmt: skip
    svg.text(x0 + sp * cw / 2, yb + 62, "data: Shard(0) on dp (batch), Shard(1) on sp "
             "(sequence)", 11)  # fmt: skip
    svg.save("mesh.svg")


def gqa(n_q: int = 8, n_kv: int = 2, sp: int = 4) -> None:
    """Which kv heads each sp rank receives when sp does not divide the kv heads."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from dtensor_ulysses.plan.splits import kv_head_index  # torch-free

    index = kv_head_index(n_q, n_kv, sp)
    assert index is not None
    m = len(index) // sp
    n = n_q // sp
    cw = 64
    x0, y0 = 110, 70
    width = x0 + n_q * cw + 60
    height = y0 + 250
    svg = Svg(width, height, f"GQA with {n_q} q heads, {n_kv} kv heads, sp={sp}")
    svg.text(width / 2, 24, f"GQA: {n_q} q heads, {n_kv} kv heads, sp={sp}: kv_head_index = "
             f"{index}", 15, weight="bold")  # fmt: skip
    group = n_q // n_kv
    svg.text(x0 - 12, y0 + 20, "q heads", 12, anchor="end")
    for i in range(n_q):
        svg.rect(x0 + i * cw + 2, y0 + 4, cw - 4, 26, COLORS[i // group], "#fff", opacity=0.85)
        svg.text(x0 + i * cw + cw / 2, y0 + 21, f"q{i}", 11, fill="#fff")
    svg.text(x0 - 12, y0 + 64, "kv heads", 12, anchor="end")
    kw = n_q * cw / n_kv
    for j in range(n_kv):
        svg.rect(x0 + j * kw + 2, y0 + 48, kw - 4, 26, COLORS[j], "#fff", opacity=0.85)
        svg.text(x0 + j * kw + kw / 2, y0 + 65, f"kv{j} (used by q{j * group}..q"
                 f"{(j + 1) * group - 1})", 11, fill="#fff")  # fmt: skip
    y1 = y0 + 130
    svg.text(x0 - 12, y1 + 24, "after the", 12, anchor="end")
    svg.text(x0 - 12, y1 + 40, "all-to-all", 12, anchor="end")
    rw = n_q * cw / sp
    for r in range(sp):
        x = x0 + r * rw
        svg.rect(x + 3, y1, rw - 6, 84, "#f6f6f6", "#999", rx=6)
        svg.text(x + rw / 2, y1 - 6, f"sp rank {r}", 11, weight="bold")
        for j in range(n):
            qi = r * n + j
            svg.rect(x + 8 + j * (rw - 16) / n, y1 + 8, (rw - 16) / n - 2, 26,
                     COLORS[qi // group], "#fff", opacity=0.85)  # fmt: skip
            svg.text(x + 8 + j * (rw - 16) / n + (rw - 16) / n / 2, y1 + 25, f"q{qi}", 10,
                     fill="#fff")  # fmt: skip
        for j in range(m):
            kv = index[r * m + j]
            svg.rect(x + 8 + j * (rw - 16) / m, y1 + 46, (rw - 16) / m - 2, 26, COLORS[kv],
                     "#fff", opacity=0.85)  # fmt: skip
            svg.text(x + 8 + j * (rw - 16) / m + (rw - 16) / m / 2, y1 + 63, f"kv{kv}", 10,
                     fill="#fff")  # fmt: skip
        svg.line(x0 + index[r * m] * kw + kw / 2, y0 + 76, x + rw / 2, y1 - 18, color="#777",
                 sw=1, dash="4 3")  # fmt: skip
    svg.text(width / 2, height - 14, "k and v are index_select-ed to these heads before the "
             "all-to-all; autograd sums the gradients of the copies", 11)  # fmt: skip
    svg.save("gqa.svg")


if __name__ == "__main__":
    all_to_all()
    mesh()
    gqa()
    print(f"wrote {sorted(p.name for p in OUT.glob('*.svg'))} to {OUT}")
