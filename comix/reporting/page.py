"""The report's page: sections of markdown and figures, rendered to one self-contained HTML file
and a markdown twin; and the figure checks a person reading the page would make."""
from __future__ import annotations

import base64
import html
import io
import re

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
          "#393b79", "#000000", "#8c6d31", "#637939", "#ad494a"]  # no grey: grey is the references' (Pretrained)
REFERENCE = "#7f7f7f"
# experts (gates, token routing) in a palette of their own (Set2): in the methods' colours, expert 0
# and 1 read as comigs-1g1s and fedavg of the figure above them
EXPERT_COLORS = ["#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3"]
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
         "td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}img{max-width:100%}"
         "code{background:#f3f3f3;padding:0 3px;border-radius:3px}"
         "figcaption{color:#555;font-size:.9em}.tok{white-space:pre-wrap;font-family:monospace;"
         "line-height:1.7;margin:.2em 0}.tok span{border-radius:3px}.panels{display:grid;grid-template-columns:1fr 1fr;"
         "gap:.6em}.panel{border:1px solid #ddd;border-radius:4px;padding:.4em;font-size:.85em}"
         "pre{background:#f7f7f7;padding:.5em;overflow:auto}figure{margin:1em 0}")  # a figure gets the page's 1100 px


def natural(name: str):
    """client2 before client10: clients in the tables' order."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def plt_():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    """Pairs of tick labels of one axis that overlap on the drawn figure (matplotlib's own text
    extents after a draw): what makes a plot unreadable at the page's width."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text().strip()]
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
            for i, (a, box_a) in enumerate(boxes):
                for b, box_b in boxes[i + 1:]:
                    if box_a.overlaps(box_b):
                        out.append((a, b))
    return out


def round_axis(ax, rounds) -> None:
    """Rounds are whole numbers: tick each evaluated round when there are few, else let matplotlib
    choose whole numbers (a single round once got ticks at 2.84 ... 3.16)."""
    from matplotlib.ticker import MaxNLocator
    rounds = sorted(set(rounds))
    if len(rounds) <= 8:
        ax.set_xticks(rounds)
        if len(rounds) == 1:
            ax.set_xlim(rounds[0] - 1, rounds[0] + 1)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))


PAGE_PX, DPI, MIN_TEXT_PX = 1100, 100, 9.5  # the page's width; a figure's text at least 7 pt at 100 dpi, unscaled
MIN_BAR_PX = 4.0  # a bar narrower than this on the page is a line whose colour cannot be told (40 devices x 7 methods drew 2 px)


def _page_scale(fig) -> float:
    """How much the page shrinks the figure: one wider than PAGE_PX is scaled down to it."""
    return min(1.0, PAGE_PX / (fig.get_figwidth() * DPI))


def small_text(fig) -> list[str]:
    """Texts of the figure smaller than MIN_TEXT_PX once the page shows it (a figure wider than
    PAGE_PX is scaled down: a 12.8-inch figure's 6-pt labels read as 6.6 px at 1280 px)."""
    from matplotlib.text import Text
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    scale = _page_scale(fig)
    return sorted({t.get_text() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
                   and t.get_window_extent(renderer).overlaps(fig.bbox) and t.get_fontsize() * DPI / 72 * scale < MIN_TEXT_PX})


def thin_bars(fig) -> list[str]:
    """Axes whose narrowest bar is under MIN_BAR_PX wide once the page shows the figure, named by
    their y label (or title) with that width."""
    from matplotlib.patches import Rectangle
    fig.canvas.draw()
    renderer, scale = fig.canvas.get_renderer(), _page_scale(fig)
    out = []
    for ax in fig.axes:
        widths = [p.get_window_extent(renderer).width * scale for p in ax.patches
                  if isinstance(p, Rectangle) and p.get_visible()]
        if widths and min(widths) < MIN_BAR_PX:
            out.append(f"{ax.get_ylabel() or ax.get_title()}: {min(widths):.1f} px")
    return out


def legend_covers(fig) -> list[str]:
    """Labels of the legends drawn over data (a line's points and segments, a bar, an error bar,
    a band, a scatter point): a legend must cover none."""
    import numpy as np
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for leg in [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends):
        box = leg.get_window_extent(renderer)
        for ax in fig.axes:
            shapes = [a.get_transform().transform(a.get_xydata()) for a in ax.lines]
            shapes += [c.get_transform().transform(p.vertices) for c in ax.collections for p in c.get_paths()
                       if len(c.get_offsets()) <= 1]
            shapes += [c.get_offset_transform().transform(c.get_offsets()) for c in ax.collections if len(c.get_offsets()) > 1]
            hit = any(p.get_window_extent(renderer).overlaps(box) for p in ax.patches)
            for xy in shapes:  # each segment sampled, so a line passing under the legend counts
                xy = np.asarray(xy, dtype=float)
                if len(xy) > 1:
                    t = np.linspace(0, 1, 25)[:, None, None]
                    xy = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)
                hit = hit or any(box.contains(x, y) for x, y in xy if np.isfinite(x) and np.isfinite(y))
            if hit:
                out.append(", ".join(t.get_text() for t in leg.get_texts()))
                break
    return out


class Style:
    """How one method is drawn in every figure: its colour and, for a variant of it (a spec with
    options: DP, a rank), its own line style, marker and bar hatch."""

    def __init__(self, color: str, ls: str = "-", marker: str = "o", hatch: str = ""):
        self.color, self.ls, self.marker, self.hatch = color, ls, marker, hatch

    def line(self) -> dict:
        return {"color": self.color, "ls": self.ls, "marker": self.marker}

    def bar(self) -> dict:
        # a white hatch and no edge: an edge line ate a narrow bar's colour
        return {"color": self.color, "hatch": self.hatch, "hatchcolor": "white", "linewidth": 0}


# One colour per method across every figure and page (a reader follows a method from page to page
# by its colour): the methods of the papers' grids keep a fixed colour whatever else a page shows; another method takes the first
# colour none on its page holds; a method's variants share its colour, told apart by line and hatch.
FIXED = ("comigs-1g1s", "fedavg", "local", "centralized", "pcl", "pfedmoe", "fdlora-comigs", "comigs-2s", "comigs-2g",
         "fedamole", "hetlora", "flexlora")
VARIANTS = [("-", "o", ""), ("--", "s", "//"), (":", "^", ".."), ("-.", "D", "xx")]


def method_styles(specs) -> dict[str, Style]:
    specs = list(dict.fromkeys(specs))
    bases = list(dict.fromkeys(s.split(":")[0] for s in specs))
    taken = {COLORS[FIXED.index(b)] for b in bases if b in FIXED}
    free = [c for c in COLORS if c not in taken]
    colour, k = {}, 0
    for b in bases:
        if b == "pretrained":
            colour[b] = REFERENCE
        elif b in FIXED:
            colour[b] = COLORS[FIXED.index(b)]
        else:
            colour[b], k = (free or COLORS)[k % len(free or COLORS)], k + 1
    out, seen = {}, {}
    for s in sorted(specs, key=lambda s: ":" in s):  # the plain method first: it gets the solid line
        b = s.split(":")[0]
        seen[b] = seen.get(b, -1) + 1
        out[s] = Style(colour[b], *VARIANTS[seen[b] % len(VARIANTS)])
    return {s: out[s] for s in specs}


class Page:
    """Sections of markdown text and figures, rendered to HTML and markdown alike. Every figure is
    checked as it is added for overlapping tick labels (``overlaps``), text too small at the page's
    width, bars too thin to see and legends over data (``unreadable``): what tests assert empty. ``styles``: each
    method's colour, the same in every figure of the page."""

    def __init__(self, title: str, specs=()):
        self.title, self.blocks = title, []  # ("md", text) | ("fig", name, png bytes, caption) | ("html", html, md)
        self.overlaps: dict[str, list[tuple[str, str]]] = {}
        self.unreadable: dict[str, list[str]] = {}
        self.styles = method_styles(specs)

    def style(self, spec: str) -> Style:
        if spec not in self.styles:
            self.styles = method_styles([*self.styles, spec])
        return self.styles[spec]

    def md(self, text: str) -> None:
        self.blocks.append(("md", text))

    def fig(self, fig, name: str, caption: str) -> None:
        plt = plt_()
        clash = overlapping_tick_labels(fig)
        if clash:
            self.overlaps[name] = clash
        bad = [f"text under {MIN_TEXT_PX} px: {t!r}" for t in small_text(fig)] + \
              [f"legend over data: {t}" for t in legend_covers(fig)] + \
              [f"bars under {MIN_BAR_PX} px wide: {t}" for t in thin_bars(fig)]
        if bad:
            self.unreadable[name] = bad
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
        plt.close(fig)
        self.blocks.append(("fig", name, buf.getvalue(), caption))

    def raw(self, html_text: str, md_text: str) -> None:
        self.blocks.append(("html", html_text, md_text))

    def markdown(self, files: str) -> tuple[str, dict[str, bytes]]:
        out, images = [f"# {self.title}", ""], {}
        for b in self.blocks:
            if b[0] == "md":
                out += [b[1], ""]
            elif b[0] == "fig":
                images[b[1]] = b[2]
                out += [f"![{b[3]}]({files}/{b[1]})", "", f"*{b[3]}*", ""]
            else:
                out += [b[2], ""]
        return "\n".join(out), images

    def html(self) -> str:
        body = [f"<h1>{html.escape(self.title)}</h1>"]
        for b in self.blocks:
            if b[0] == "md":
                body.append(md_to_html(b[1]))
            elif b[0] == "fig":
                data = base64.b64encode(b[2]).decode()
                body.append(f'<figure><img alt="{html.escape(b[3])}" src="data:image/png;base64,{data}">'
                            f"<figcaption>{inline(b[3])}</figcaption></figure>")
            else:
                body.append(b[1])
        return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>")


NUMBER = re.compile(r"^[-+]?[\d,.]+(e[-+]?\d+)?( \([\d.e+-]+\))?( / [-+]?[\d,.]+)?%?$|^-$|^inf.*$")


def inline(text: str) -> str:
    """Escaped text with markdown's inline code (`x`) and bold (**x**) as HTML."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


def md_to_html(text: str) -> str:
    """The little markdown the report writes: headings, tables (numbers right-aligned, text left),
    bullet lines, paragraphs, code blocks, inline code and bold."""
    out, table, in_code = [], [], False
    for line in text.splitlines() + [""]:
        if line.startswith("```"):
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                table.append(cells)
            continue
        if table:
            head, *rows = table
            out.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>" +
                       "".join("<tr>" + "".join(f"<td class='n'>{inline(c)}</td>" if NUMBER.match(c) else
                                                f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rows) +
                       "</table>")
            table = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level + 1}>{inline(line.lstrip('#').strip())}</h{level + 1}>")
        elif line.startswith("- "):
            out.append(f"<p>&bull; {inline(line[2:])}</p>")
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
    return "\n".join(out)
