"""`comix report`: sections drawn from the records, a self-contained page that
a real headless Chromium loads with every image decoded and no console error, markdown twin,
one-line refusal of a folder that is not a run."""
import json
import re
import shutil

import pytest

from comix.cli import main
from test_cli import TINY, _user_dirs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    data = _user_dirs(root / "data")
    run = root / "run"
    assert main(["compare", f"corpus={data}", f"run_dir={run}", *TINY, "--methods", "fedavg", "comigs-1g1s",
                 "fedavg:privacy.clip=0.05,privacy.noise_multiplier=1", "--seeds", "1", "2"]) == 0
    return run


def test_the_report_has_a_section_per_kind_of_record(run, capsys):
    assert main(["report", str(run)]) == 0
    assert f"report: {run / 'report.html'}" in capsys.readouterr().out
    page, md = (run / "report.html").read_text(), (run / "report.md").read_text()
    for heading in ("Results", "Learning curves", "Expert scores over training", "Token routing",
                    "Communication and compute", "What left each device"):
        assert heading in page and heading in md, heading
    # results over both seeds with std, and each method's scoring rule
    assert re.search(r"\| comigs-1g1s \| [\d.]+ \([\d.]+\) \| 2 \| - \| each client's model after it takes", md)
    # only a mixture gets gates and routing; the DP run's epsilon is in the traffic table
    assert "gates-comigs-1g1s.png" in md and "gates-fedavg.png" not in md
    assert "comigs-1g1s, user alice's model on bob's text" in md
    eps = json.loads((run / "seed1" / "fedavg__privacy.clip=0.05_privacy.noise_multiplier=1" / "results.json")
                     .read_text())["epsilon"]
    assert f"{eps:.3g} |" in md
    # what the run was, at the top, and that a random tiny model's numbers are not results
    setup = next(ln for ln in md.splitlines() if ln.startswith("**Setup**"))
    assert "model `tiny-llama`" in setup and "2 rounds" in setup and "**Warning**" in setup
    assert md.index("**Setup**") < md.index("Results")
    # self-contained: every image inline, nothing fetched
    assert page.count("data:image/png;base64,") == len(re.findall(r"!\[", md)) >= 3
    assert not re.search(r"(src|href)=\"(https?:|//)", page)
    for name in re.findall(r"\]\(report-files/([^)]+)\)", md):
        assert (run / "report-files" / name).stat().st_size > 1000


def test_the_page_loads_in_headless_chromium_with_every_image_decoded(run, tmp_path):
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.skip("chromium / chromedriver are not installed (CI installs the Debian packages)")
    webdriver = pytest.importorskip("selenium.webdriver")
    main(["report", str(run)])
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,2400"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver")))
    try:
        driver.get((run / "report.html").as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        assert len(images) >= 3 and all(ok and w > 100 and h > 100 for ok, w, h in images), images
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        assert driver.execute_script("return document.querySelectorAll('.tok span').length") > 100
        assert driver.save_screenshot(str(tmp_path / "report.png"))
    finally:
        driver.quit()
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a comix run" in err[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_gates_of_modules_with_different_expert_counts_are_drawn(tmp_path):
    """FedAMoLE gives each module its own number of expert slots: the expert-score figure averages
    each slot over the modules that have it (a run's report once failed on this)."""
    from comix.reporting import Page, gates_section
    rows = [{"round": r, "user": u, "gates": [[0.5, 0.5], [0.2, 0.3, 0.5], [1.0]]} for r in (1, 2) for u in ("a", "b")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = Page("t")
    gates_section(page, {"fedamole": {1: tmp_path}})
    figs = [b for b in page.blocks if b[0] == "fig"]
    assert len(figs) == 1 and figs[0][2][:4] == b"\x89PNG"


def test_the_report_of_a_run_scored_once_has_pretrained_bars_routing_and_readable_figures(tmp_path):
    """The main job evaluates only its last round (``train.eval_every``): the report still has the
    token routing maps, draws a bar per method instead of a one-point curve, lists Pretrained (a
    method folder with results.json alone), plots the training loss, says Local sends nothing, and
    no figure has overlapping tick labels."""
    from comix.reporting import build_page
    data = _user_dirs(tmp_path / "data")
    run = tmp_path / "run"
    args = [a for a in TINY if not a.startswith("train.eval_every")] + ["train.eval_every=2"]
    assert main(["run", f"corpus={data}", f"run_dir={run}", "methods=[pretrained,local,comigs-1g1s]", *args]) == 0
    page = build_page(run)
    md, _ = page.markdown("f")
    assert "| pretrained | " in md and "the frozen base" in md
    assert "each client's own model after its local training (nothing is shared)" in md
    assert "## Final scores" in md and "## Learning curves" not in md and "## Training loss" in md
    assert "## Token routing" in md and "comigs-1g1s, user alice's model on bob's text" in md
    assert "local: nothing left any device" in md and "| local | 1 |" not in md
    assert page.overlaps == {} and page.unreadable == {}
    assert "<code>train.eval_every</code>" in page.html()  # markdown's inline code is rendered


def test_overlapping_tick_labels_are_found():
    from comix.reporting import overlapping_tick_labels
    from comix.reporting.page import plt_
    plt = plt_()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.set_xticks(range(6), [f"a long method name {i}" for i in range(6)])
    assert overlapping_tick_labels(fig)
    ax.set_xticks(range(6), [str(i) for i in range(6)])
    assert overlapping_tick_labels(fig) == []
    plt.close(fig)


def test_a_dp_compare_s_report_shows_utility_against_epsilon(run):
    from comix.reporting import build_page
    page = build_page(run, routing=False)
    md, images = page.markdown("f")
    assert "### Utility against privacy" in md and "privacy.png" in images
    assert "| fedavg clip=0.05 sigma=1 | 0.05 | 1 |" in md  # a spec's options as a short label
    assert "epsilon |" in md.split("Per user")[0]  # the results table has the epsilon column
    assert page.overlaps == {} and page.unreadable == {}
    # a spec by its short name in every table, the full spec once, in the legend table at the top
    spec = "fedavg:privacy.clip=0.05,privacy.noise_multiplier=1"
    assert f"| fedavg clip=0.05 sigma=1 | `{spec}` |" in md and md.count(spec) == 1 + md.count(f"`{spec}`") - 1
    assert md.index(f"`{spec}`") < md.index("## Results") and "| fedavg clip=0.05 sigma=1 | " in md.split("Per user")[0]
    assert "band: population std over seeds" in md  # two seeds: the spread drawn


def test_the_gates_figure_takes_a_client_whose_experts_grew_between_rounds(tmp_path):
    """RSEA may give a client fewer experts in every module in an early round than in the last
    one (FedAMoLE): those rounds have no value for the later slots, drawn blank, not a crash."""
    import json

    from comix.reporting.page import Page
    from comix.reporting.sections import gates_section
    d = tmp_path / "fedamole"
    d.mkdir()
    rows = [{"round": 1, "user": "a", "gates": [[0.6, 0.4], [0.5, 0.5]]},
            {"round": 2, "user": "a", "gates": [[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]]}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = Page("t")
    gates_section(page, {"fedamole": {42: d}})
    assert any(b[0] == "fig" for b in page.blocks)


def test_utility_against_epsilon_labels_every_epsilon_and_shows_the_spread_over_seeds():
    """A log axis within one decade draws no labelled tick of its own: each epsilon run gets one;
    the std over seeds is an error bar; a method with one noise level says so in its legend."""
    from comix.reporting.figures import privacy_figure
    one, two = {"privacy": {"noise_multiplier": 1.0}}, {"privacy": {"noise_multiplier": 2.0}}
    results = {"fedavg": {1: {"metric": "test_ppl", "mean": 30.0}},
               "fedavg:privacy.noise_multiplier=1": {1: {"metric": "test_ppl", "mean": 40.0, "epsilon": 4.87, **one},
                                                     2: {"metric": "test_ppl", "mean": 42.0, "epsilon": 4.87, **one}},
               "fedavg:privacy.noise_multiplier=2": {1: {"metric": "test_ppl", "mean": 35.0, "epsilon": 2.1, **two}},
               "comigs-1g1s:privacy.noise_multiplier=1": {1: {"metric": "test_ppl", "mean": 38.0, "epsilon": 4.87, **one}}}
    fig = privacy_figure(results)
    ax = fig.axes[0]
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels == ["2.1\nsigma 2", "4.87\nsigma 1"]  # sigma written at each epsilon
    from comix.reporting.page import legend_covers, method_styles
    assert legend_covers(fig) == []
    # each method in its colour of every other figure, and the two at epsilon 4.87 side by side, not on top
    from matplotlib.colors import to_hex
    styles = method_styles(results)
    drawn = {c.get_label(): to_hex(c.lines[0].get_color()) for c in ax.containers}
    assert drawn["fedavg"] == styles["fedavg"].color and drawn["comigs-1g1s (one noise level)"] == styles[
        "comigs-1g1s:privacy.noise_multiplier=1"].color != styles["fedavg"].color
    xs = sorted(x for c in ax.containers for x in c.lines[0].get_xdata() if abs(x - 4.87) < 0.5)
    assert len(xs) == 2 and xs[0] < xs[1]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "comigs-1g1s (one noise level)" in legend and "fedavg" in legend and "fedavg, no DP" in legend
    caps = [c for c in ax.containers if hasattr(c, "has_yerr") and c.has_yerr]
    assert caps  # error bars drawn
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_compare_curves_of_one_evaluated_iteration_are_bars_in_the_report_s_colours(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from comix.reporting.figures import plot_curves
    from comix.reporting.page import method_styles
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    data = {"local": {"de": [(12, 30.0)], "fr": [(12, 32.0)]}, "fedavg": {"de": [(12, 28.0)], "fr": [(12, 29.0)]}}
    assert plot_curves(data, tmp_path / "c.png", per_user=False)
    ax = kept[-1].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["local", "fedavg"]
    assert [p.get_height() for p in ax.patches] == [31.0, 28.5]
    from matplotlib.colors import to_hex
    styles = method_styles(["local", "fedavg"])
    assert [to_hex(p.get_facecolor()) for p in ax.patches] == [styles["local"].color, styles["fedavg"].color]
    data = {"local": {"de": [(4, 30.0), (8, 28.0)]}}  # two iterations: a curve, whole-number ticks
    assert plot_curves(data, tmp_path / "d.png", per_user=False)
    ax = kept[-1].axes[0]
    assert not ax.patches and to_hex(ax.lines[0].get_color()) == styles["local"].color
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_the_gates_of_many_clients_are_drawn_four_to_a_row_and_the_caption_names_those_left_out(tmp_path):
    from comix.reporting import Page, gates_section
    users = [f"client{i:02d}" for i in range(10)]
    rows = [{"round": r, "user": u, "gates": [[0.4, 0.6], [0.5, 0.5]]} for r in (1, 2) for u in users]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = Page("t")
    gates_section(page, {"comigs-1g1s": {1: tmp_path}})
    fig_block = next(b for b in page.blocks if b[0] == "fig")
    caption = fig_block[3]
    assert "8 of the 10 clients, the first scored: client00, client01, client02, client03, client04, client05, " \
           "client06, client07" in caption  # the clients drawn, each named
    assert not page.overlaps  # tick labels readable: four users a row, not ten squeezed into one


def test_text_too_small_at_the_page_s_width_and_legends_over_data_are_found():
    """What pages looked at in Chromium at 1280 px showed: a 12.8-inch figure with 6-pt labels (shown at 1100 px,
    they read as 6.6 px) and a legend inside the axes over the last devices' bars."""
    from comix.reporting.page import legend_covers, plt_, small_text
    plt = plt_()
    fig, ax = plt.subplots(figsize=(12.8, 3))
    ax.bar(range(4), [1, 1, 1, 1], label="a method")
    ax.set_xticks(range(4), ["de", "fr", "it", "nl"], fontsize=6)
    ax.legend(loc="upper right")
    assert set(small_text(fig)) == {"de", "fr", "it", "nl"}
    assert legend_covers(fig) == ["a method"]
    ax.set_xticks(range(4), ["de", "fr", "it", "nl"], fontsize=9)
    ax.get_legend().remove()
    fig.set_figwidth(10)
    fig.legend(loc="outside upper center")
    assert small_text(fig) == [] and legend_covers(fig) == []
    fig, ax = plt.subplots(figsize=(6, 3))  # a line passing under the legend, no point inside it
    ax.plot([0, 10], [0, 10], label="a line")
    ax.legend(loc="center")
    assert legend_covers(fig) == ["a line"]
    plt.close("all")


def test_bars_too_thin_to_see_are_found():
    """40 devices x 7 methods drew bars 2 px wide on the DP page: their colours could not be told."""
    from comix.reporting.page import plt_, thin_bars
    plt = plt_()
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.bar([j + i * 0.8 / 7 for j in range(40) for i in range(7)], 1.0, 0.8 / 7)
    ax.set_ylabel("memory")
    assert len(thin_bars(fig)) == 1 and thin_bars(fig)[0].startswith("memory: ")
    fig, ax = plt.subplots(figsize=(10, 3))
    ax.bar(range(40), 1.0, 0.8)  # one method: 18 px a bar
    assert thin_bars(fig) == []
    plt.close("all")


def test_many_devices_under_several_methods_are_points_per_method_in_client_order(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from comix.reporting import Page
    from comix.reporting.devices import devices_section
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    runs = {}
    for k, spec in enumerate(["fedavg", "local", "fedavg:privacy.clip=0.3,privacy.noise_multiplier=1"]):
        rows = [{"round": 1, "user": f"client{i}", "memory_mb": 100.0 + i + k, "bytes_up": 2**20, "tokens": 10}
                for i in range(40)]
        runs[spec] = {1: _metrics(tmp_path / spec.replace(":", "_"), rows)}
    page = Page("t", runs)
    devices_section(page, runs)
    assert page.unreadable == {} and page.overlaps == {}  # the 2-px bars of a bar per device and method
    memory = kept[0].axes[0]
    from matplotlib.collections import PathCollection
    points = [c for c in memory.collections if isinstance(c, PathCollection)]
    assert not memory.patches and len(points) == 3  # a column of points per method, no bars
    ys = points[0].get_offsets()[:, 1]
    assert list(ys) == [100.0 + i for i in range(40)]  # client2 before client10: the tables' order
    md, _ = page.markdown("f")
    assert "Each of the 40 devices'" in md and "| fedavg | client10 |" in md


def test_per_user_bars_without_the_untrained_base_say_why_it_is_missing(tmp_path):
    from comix.reporting import Page
    from comix.reporting.curves import curves_section
    runs = {}
    for spec, base in (("fedavg", 30.0), ("local", 32.0)):
        rows = [{"round": 3, "user": u, "test_ppl": base + i} for i, u in enumerate(["de", "fr"])]
        runs[spec] = {1: _metrics(tmp_path / spec, rows)}
        (runs[spec][1] / "results.json").write_text(json.dumps({"method": spec, "rounds": 3, "mean": base, "per_user": {}}))
    page = Page("t", runs)
    curves_section(page, runs)
    caption = next(b[3] for b in page.blocks if b[0] == "fig" and b[1] == "curves-per-user.png")
    assert "no Pretrained reference" in caption and "`pretrained`" in caption


def test_a_method_has_one_colour_whatever_else_the_page_shows():
    """The same colour for a method on every page (comigs-1g1s was blue on one page and orange on
    another, pfedmoe the grey of the Pretrained reference); its variants share it, drawn dashed and
    hatched."""
    from comix.reporting.page import REFERENCE, method_styles
    a = method_styles(["comigs-1g1s", "fedavg"])
    b = method_styles(["centralized", "comigs-1g1s", "comigs-2g", "fedavg", "local", "pfedmoe", "pretrained",
                       "fedavg:privacy.clip=0.3,privacy.noise_multiplier=1", "hetlora:reg=0.05", "fedit", "fedprompt"])
    assert a["comigs-1g1s"].color == b["comigs-1g1s"].color and a["fedavg"].color == b["fedavg"].color
    colours = [st.color for s, st in b.items() if ":" not in s and s != "pretrained"]
    assert len(set(colours)) == len(colours) and REFERENCE not in colours and b["pretrained"].color == REFERENCE
    dp = b["fedavg:privacy.clip=0.3,privacy.noise_multiplier=1"]
    assert dp.color == b["fedavg"].color and (dp.ls, dp.hatch) != (b["fedavg"].ls, b["fedavg"].hatch)


def _metrics(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_curves_over_seeds_have_a_band_and_a_sampled_round_says_so(tmp_path, monkeypatch):
    """Two seeds: the std over seeds drawn as a band; rounds that scored a sample of the clients
    (train.eval_clients) say so in the caption; the legend beside the plot, over no data."""
    import matplotlib.pyplot as plt

    from comix.reporting.curves import curves_section
    from comix.reporting.page import Page
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    runs = {}
    for spec, base in (("fedavg", 30.0), ("local", 32.0)):
        for seed in (1, 2):
            rows = [{"round": r, "user": u, "test_ppl": base - r + seed, "train_loss": 3.0 - 0.1 * r + 0.01 * seed}
                    for r in (1, 2, 3) for u in (["c0", "c1", "c2", "c3"] if r == 3 else ["c1"])]
            runs.setdefault(spec, {})[seed] = d = _metrics(tmp_path / f"seed{seed}" / spec, rows)
            (d / "results.json").write_text(json.dumps({"method": spec, "rounds": 3, "mean": base, "per_user": {}}))
    page = Page("t", runs)
    curves_section(page, runs)
    caption = next(b[3] for b in page.blocks if b[0] == "fig" and b[1] == "curves.png")
    assert "band: population std over seeds" in caption and "rounds 1 to 2 scored a sample of 1 of the 4 clients" in caption
    ax = kept[0].axes[0]
    assert len(ax.collections) == 2  # a band per method
    assert page.unreadable == {} and page.overlaps == {}


def test_gates_of_one_evaluated_round_are_bars_not_lone_dots(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from comix.reporting import Page, gates_section
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    rows = [{"round": 3, "user": u, "gates": [[0.4, 0.6], [0.5, 0.5]]} for u in ("de", "fr")]
    page = Page("t")
    gates_section(page, {"comigs-1g1s": {1: _metrics(tmp_path / "m", rows)}})
    top = kept[0].axes[0]
    assert not top.lines and len(top.patches) == 2
    assert page.unreadable == {} and page.overlaps == {}
