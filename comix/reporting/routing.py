"""Token routing colour maps (CoMiGS Fig. 3, 14-19): each user's rebuilt model on test texts of
every domain, each token coloured by the expert its router ranks first."""
from __future__ import annotations

import html
from pathlib import Path

from .page import EXPERT_COLORS as COLORS, Page, natural  # experts: their own palette
from .records import jsonl


def routing_section(page: Page, runs: dict[str, dict[int, Path]], texts_per_user: int = 1, tokens: int = 48) -> None:
    """Token routing colour maps for every mixture method (top-1 expert of each token at the
    first, middle and last mixture layer), on the first ``tokens`` tokens of each user's test split."""
    import torch

    from ..config import load_config
    from ..data import load_corpus, make_user_data
    from ..models import mixtures, routing_stats, set_record_stats
    from ..personal import ExportError, rebuild, run_config
    from ..comparison import short_spec
    blocks, n_experts, shown = [], 1, {}
    seeds = {s for by in runs.values() for s in by}
    for spec, by in runs.items():
        d = by[min(by)]
        # gates are recorded in evaluated rounds only (``train.eval_every``): any round names the users
        users = sorted(dict.fromkeys(r["user"] for r in jsonl(d / "metrics.jsonl") if "gates" in r), key=natural)
        if not users or not (d / "adapters").is_dir():
            continue
        cfg = load_config(str(run_config(d)))
        data = None
        for user in users[:4]:
            try:
                model, tok, _ = rebuild(d, user)
            except (ExportError, KeyError, ValueError):
                break
            layers = mixtures(model)
            if not layers:
                break
            if data is None:
                data = {u.name: u for u in make_user_data(load_corpus(cfg.corpus), tok, cfg.data)}
            picked = sorted({0, len(layers) // 2, len(layers) - 1})
            shown.setdefault(short_spec(spec), ([], list(data)[:4], len(users), len(data)))[0].append(user)
            for domain, u in list(data.items())[:4]:
                ids = u.test[:tokens].long() if u.task == "lm" else u.test.sample(1, torch.Generator().manual_seed(0))[0][0, :tokens]
                set_record_stats(model, True)
                with torch.inference_mode():
                    model(input_ids=ids.reshape(1, -1))
                stats = routing_stats(model)
                set_record_stats(model, False)
                n_experts = max(n_experts, *(len(st["mean_gate"]) for st in stats))
                pieces = token_pieces(tok, ids.tolist())
                lines_h, lines_m = [], []
                for li in picked:
                    top1 = stats[li]["top1"].reshape(-1).tolist()
                    spans = "".join(f'<span style="background:{COLORS[e % len(COLORS)]}88" title="expert {e}">'
                                    f"{html.escape(p)}</span>" for p, e in zip(pieces, top1))
                    lines_h.append(f"<div class='tok'><small>layer {li}:</small> {spans}</div>")
                    lines_m.append(f"layer {li}: " + " ".join(f"{p.strip() or '_'}[{e}]" for p, e in zip(pieces, top1)))
                label = f"{short_spec(spec)}, user {user}'s model on {domain}'s text"
                blocks.append((f"<div class='panel'><b>{html.escape(label)}</b>{''.join(lines_h)}</div>",
                               f"**{label}**\n\n" + "\n\n".join(lines_m)))
    if blocks:
        legend = " ".join(f'<span style="background:{c}88;padding:0 4px">expert {i}</span>' for i, c in enumerate(COLORS[:n_experts]))
        page.md("## Token routing\n\nEach token of a test text, coloured by the expert its router ranks first "
                "(CoMiGS Fig. 3, 14-19); one panel per (user model, text domain) at the first, middle and last layer."
                + (f" Each method's first seed, {min(seeds)} of {sorted(seeds)}." if len(seeds) > 1 else "")
                + "".join(f" {m}: the models of {', '.join(u)}" + (f" (4 of its {nu} users)" if nu > len(u) else "")
                          + f" on the texts of {', '.join(t)}" + (f" (4 of {nt})" if nt > len(t) else "") + "."
                          for m, (u, t, nu, nt) in shown.items()))
        page.raw(f"<p>{legend}</p>", "Markdown: each token is followed by [its top-1 expert].")
        page.raw("<div class='panels'>" + "".join(h for h, _ in blocks) + "</div>", "\n\n".join(m for _, m in blocks))


def token_pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds (decoding prefixes), so a character split over byte-level tokens
    shows whole, at the token that completes it, instead of as replacement characters."""
    out, prev = [], ""
    for i in range(len(ids)):
        text = tok.decode(ids[:i + 1])
        if text.endswith("\ufffd"):  # an incomplete character: wait for the token that completes it
            out.append("")
            continue
        out.append(text[len(prev):])
        prev = text
    return out
