"""The report's page: sections of markdown and figures, rendered to one self-contained HTML file
and a markdown twin; and the figure checks a person reading the page would make."""
from __future__ import annotations

import base64
import html
import io
import re

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
         "td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}img{max-width:100%}"
         "code{background:#f3f3f3;padding:0 3px;border-radius:3px}"
         "figcaption{color:#555;font-size:.9em}.tok{white-space:pre-wrap;font-family:monospace;"
         "line-height:1.7;margin:.2em 0}.tok span{border-radius:3px}.panels{display:grid;grid-template-columns:1fr 1fr;"
         "gap:.6em}.panel{border:1px solid #ddd;border-radius:4px;padding:.4em;font-size:.85em}"
         "pre{background:#f7f7f7;padding:.5em;overflow:auto}")


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


class Page:
    """Sections of markdown text and figures, rendered to HTML and markdown alike. Every figure is
    checked for overlapping tick labels as it is added (``overlaps``: what a test asserts empty)."""

    def __init__(self, title: str):
        self.title, self.blocks = title, []  # ("md", text) | ("fig", name, png bytes, caption) | ("html", html, md)
        self.overlaps: dict[str, list[tuple[str, str]]] = {}

    def md(self, text: str) -> None:
        self.blocks.append(("md", text))

    def fig(self, fig, name: str, caption: str) -> None:
        plt = plt_()
        clash = overlapping_tick_labels(fig)
        if clash:
            self.overlaps[name] = clash
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
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
