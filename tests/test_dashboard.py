"""The dask_dl page on a real scheduler's dashboard: what runs publish, how it is checked, what a browser shows."""

import asyncio
import html
import json
import math
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from urllib.parse import urlparse

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.utils_test import gen_cluster

from dask_dl import ConfigurationError, dashboard
from dask_dl.dashboard.page import RunsPage
from dask_dl.dashboard.sweep_page import SweepsPage
from dask_dl.testing.browser import Browser, find_chromium
from dask_dl.testing.servers import unavailable

GOOD = {
    "status": "finished",
    "model": "small_cnn",
    "compression": "onebit",
    "trainers": 2,
    "epoch": 1,
    "epochs": 2,
    "global_batch": 16,
    "images_per_s": 512.5,
    "data_wait_share": 0.02,
    "bytes_sent": 1000,
    "bytes_uncompressed": 4000,
    "history": [
        {"epoch": 0, "train_loss": 0.7, "val_loss": 0.72, "val_auroc_mean": 0.6}
        | {"val_auroc_A": 0.5, "val_auroc_B": 0.7},
        {"epoch": 1, "train_loss": 0.5, "val_loss": 0.6, "val_auroc_mean": 0.7}
        | {"val_auroc_A": 0.75, "val_auroc_B": None},  # B: no positive sample in this validation split
    ],
}

# issue 11: each of these once turned the whole page into HTTP 500; (snapshot, what the problem names)
MALFORMED = {
    "non-numeric loss": ({"status": "running", "loss": "abc", "history": []}, "loss is 'abc' (str), not a number"),
    "non-numeric row": (
        {"status": "running", "history": [{"epoch": 0, "train_loss": "0.5?"}]},
        "history[0]['train_loss'] is '0.5?' (str), not a number",
    ),
    "history not a list": ({"status": "running", "history": "oops"}, "history is 'oops' (str), not a list"),
    "history a dict": ({"status": "running", "history": {"epoch": 0}}, "not a list of epoch rows"),
    "row not a dict": ({"status": "running", "history": [0.5]}, "history[0] is 0.5 (float), not a dict"),
    "missing status": ({"history": []}, "missing key 'status'"),
    "row without epoch": ({"status": "running", "history": [{"train_loss": 0.5}]}, "history[0] misses key 'epoch'"),
    "epoch None": (
        {"status": "running", "history": [{"epoch": None, "train_loss": 0.5}]},
        "history[0]['epoch'] is None",
    ),
    "status not a string": ({"status": 3, "history": []}, "status is 3 (int), not a string"),
    "bool as a number": ({"status": "running", "trainers": True}, "trainers is True (bool), not a number"),
}


SWEEP = {
    "status": "running",
    "metric": "val_auroc_mean",
    "direction": "maximize",
    "best_trial": 1,
    "trials": [
        {"number": 0, "state": "pruned", "params": {"lr": 1e-05}, "curve": [0.5], "best": 0.5, "epochs": 1},
        {"number": 1, "state": "complete", "params": {"lr": 0.1}, "curve": [0.8, 0.95], "best": 0.95, "epochs": 2}
        | {"seconds": 3.25, "run_id": "run-t1"},
        {"number": 2, "state": "running", "params": {"lr": 0.01}, "curve": [], "epochs": 0},
        {"number": 3, "state": "failed", "params": {"lr": 0.3}, "curve": [None], "error": "TrainingError: boom"},
    ],
}
MALFORMED_SWEEPS = {
    "no trials": ({"status": "running", "metric": "val_loss"}, "missing key 'trials'"),
    "metric not a string": ({"status": "running", "metric": 3, "trials": []}, "metric is 3 (int), not a string"),
    "trials a dict": ({"status": "running", "metric": "m", "trials": {"0": 1}}, "not a list of trials"),
    "trial without state": (
        {"status": "done", "metric": "m", "trials": [{"number": 0}]},
        "trials[0] misses key 'state'",
    ),
    "curve of text": (
        {"status": "done", "metric": "m", "trials": [{"number": 0, "state": "complete", "curve": [0.5, "x"]}]},
        "trials[0]['curve'][1] is 'x' (str), not a number",
    ),
    "number None": (
        {"status": "done", "metric": "m", "trials": [{"number": None, "state": "complete"}]},
        "trials[0]['number'] is None (NoneType), not a number",
    ),
}


def _local(url: str) -> str:
    # the dashboard link names the machine's address; ask over loopback instead
    return url.replace(urlparse(url).hostname, "127.0.0.1", 1)


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read().decode()


def _document_texts(url: str) -> str:
    """The text of every Div of the page's Bokeh document, pulled over a real Bokeh client session."""
    from bokeh.client import pull_session
    from bokeh.models import Div

    with pull_session(url=url) as session:
        return "\n".join(div.text for div in session.document.select({"type": Div}))


def _wait_for(url, ready, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        runs = json.loads(_get(url)[1])
        if ready(runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)


# ---- checks and publishing, no cluster -----------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_check_run_names_each_problem(case):
    snapshot, problem = MALFORMED[case]
    problems = dashboard.check_run(snapshot)
    assert len(problems) == 1 and problem in problems[0]
    with pytest.raises(ConfigurationError, match=re.escape(problem)):
        dashboard.publish(None, "run-x", snapshot)  # refused before anything is sent


def test_check_run_accepts_snapshots_with_gaps():
    assert dashboard.check_run(GOOD) == []
    assert dashboard.check_run({"status": "running"}) == []  # nothing measured yet
    assert dashboard.check_run({"status": "running", "loss": None, "history": []}) == []  # NaN travels as None
    assert dashboard.check_run({**GOOD, "history": tuple(GOOD["history"])}) == []  # msgpack's tuples
    many = {"status": "running", "history": [{"epoch": i, "train_loss": "x"} for i in range(9)]}
    assert dashboard.check_run(many)[-1] == "and 4 more"


def test_publish_refuses_bad_arguments():
    with pytest.raises(ConfigurationError, match="run_id must be a non-empty string, got 3"):
        dashboard.publish(None, 3, GOOD)
    with pytest.raises(ConfigurationError, match="must be a dict like TrainingRun.snapshot"):
        dashboard.publish(None, "run-x", [GOOD])


def test_runs_from_events_skips_what_is_not_a_run():
    events = [(1.0, "text"), (2.0, {"no": "run id"}), (3.0, {"run_id": 7, "status": "running"}), "junk"]
    events += [(4.0, {"run_id": "a", "status": "running"}), (5.0, {"run_id": 7, "status": "finished"})]
    assert dashboard.runs_from_events(events) == {"7": {"status": "finished"}, "a": {"status": "running"}}


def test_store_keeps_the_latest_runs():
    store = dashboard.RunStore(max_runs=2)
    for msg in ({"run_id": "a", "status": "running"}, "junk", {"run_id": "b", "status": "running"}):
        store.fold(msg)
    store.fold({"run_id": "a", "status": "finished"})
    assert store.runs == {"a": {"status": "finished"}, "b": {"status": "running"}} and store.version == 3
    store.fold({"run_id": "c", "status": "running"})
    assert list(store.runs) == ["b", "c"]  # the run started first goes
    with pytest.raises(ConfigurationError, match="dask-dl.dashboard.max-runs must be a positive integer"):
        dashboard.RunStore(max_runs=0)


# ---- the Bokeh document, drawn from events (real Bokeh models, no browser) -----------------------------------


def test_page_draws_each_run_on_its_own():
    events = [(0.0, {"run_id": "good", **GOOD, "history": tuple(GOOD["history"])})]  # as msgpack hands it over
    events += [(1.0 + i, {"run_id": f"bad-{case}", **MALFORMED[case][0]}) for i, case in enumerate(sorted(MALFORMED))]
    page = RunsPage(lambda: (len(events), dashboard.runs_from_events(events)))
    page.update()
    good = page.panels["good"]
    assert not good.error.visible and good.plots.visible
    assert good.curves.data == {
        "epoch": [1, 2],  # completed epochs
        "train_loss": [0.7, 0.5],
        "val_loss": [0.72, 0.6],
        "val_auroc_mean": [0.6, 0.7],
    }
    assert list(page.panels["good"].labels.data["label"]) == ["A", "B"]
    assert good.labels.data["text"] == ["0.750", "n/a"]  # the latest epoch's per-label AUROC
    assert good.per_label.title.text == "per-label AUROC, epoch 2"
    for fact in ("2 / 2", "16", "512.5", "2.0%", "25.0% of 4.0 kB"):
        assert fact in good.facts.text
    for case, (_, problem) in MALFORMED.items():
        panel = page.panels[f"bad-{case}"]
        assert panel.error.visible and panel.plots is None, case  # no figures for a malformed run
        assert problem.replace("'", "&#x27;") in panel.error.text, case
        assert "The other runs are not affected" in panel.error.text
    assert list(page.comparison.sources) == ["good"]  # the malformed runs are named in the table only
    assert page.comparison.table.text.count("malformed: see its panel") == len(MALFORMED)
    assert page.comparison.sources["good"].data["val_auroc_mean"] == [0.6, 0.7]

    # a run that publishes a good snapshot later is drawn again; the others stay as they are
    events.append((99.0, {"run_id": "bad-history not a list", "history": GOOD["history"]}))
    page.update()
    fixed = page.panels["bad-history not a list"]
    assert not fixed.error.visible and fixed.curves.data["train_loss"] == [0.7, 0.5]
    assert page.panels["bad-row not a dict"].error.visible


def test_page_survives_what_the_checks_let_through():
    """Values that pass the checks but not the drawing break their own panel only, never the page."""
    runs = {
        "infinite": {"status": "running", "history": [{"epoch": 0, "train_loss": math.inf, "val_auroc_mean": 0.5}]},
        "huge": {"status": "running", "history": [{"epoch": 0, "train_loss": 10**400}]},  # no float holds it
        "good": GOOD,
    }
    page = RunsPage(lambda: (1, runs))
    page.update()
    infinite = page.panels["infinite"]
    assert not infinite.error.visible and math.isnan(infinite.curves.data["train_loss"][0])  # a gap, not an axis to inf
    huge = page.panels["huge"]
    assert huge.error.visible and "OverflowError: int too large to convert to float" in huge.error.text
    assert "huge: OverflowError" in page.comparison.error.text and page.comparison.error.visible
    assert not page.panels["good"].error.visible and list(page.comparison.sources) == ["infinite", "huge", "good"]


def test_page_follows_a_store_that_changes_in_place():
    store = dashboard.RunStore(max_runs=2)
    page = RunsPage(lambda: (store.version, store.runs))
    store.fold({"run_id": "a", **GOOD, "history": GOOD["history"][:1]})
    page.update()
    assert page.panels["a"].curves.data["train_loss"] == [0.7]
    store.fold({"run_id": "a", "history": GOOD["history"]})  # the same dict, updated
    page.update()
    assert page.panels["a"].curves.data["train_loss"] == [0.7, 0.5]
    store.fold({"run_id": "b", **GOOD})
    store.fold({"run_id": "c", **GOOD})  # "a" leaves the store
    page.update()
    assert list(page.panels) == ["b", "c"] and list(page.comparison.sources) == ["b", "c"]
    assert [item.label.value for item in page.comparison.loss.legend[0].items] == ["b", "c"]
    assert len(page.grid.children) == 1 and len(page.grid.children[0].children) == 2  # side by side


def test_page_without_runs():
    page = RunsPage(lambda: (0, {}))
    page.update()
    assert page.empty.visible and "No runs yet" in page.empty.text
    assert not page.comparison.root.visible


@pytest.mark.parametrize("case", sorted(MALFORMED_SWEEPS))
def test_check_sweep_names_each_problem(case):
    snapshot, problem = MALFORMED_SWEEPS[case]
    problems = dashboard.check_sweep(snapshot)
    assert len(problems) == 1 and problem in problems[0], problems
    with pytest.raises(ConfigurationError, match=re.escape(problem)):
        dashboard.publish_sweep(None, "sweep-x", snapshot)  # refused before anything is sent
    assert dashboard.check_sweep(SWEEP) == []


def test_sweeps_page_draws_every_trial_pruned_ones_marked_and_bad_sweeps_boxed():
    events = [(0.0, {"sweep_id": "s1", **SWEEP}), (1.0, {"run_id": "a run", "status": "running"})]  # not a sweep
    events += [
        (2.0 + i, {"sweep_id": f"bad-{case}", **snap}) for i, (case, (snap, _)) in enumerate(MALFORMED_SWEEPS.items())
    ]
    page = SweepsPage(lambda: (len(events), dashboard.runs_from_events(events, key="sweep_id")))
    page.update()
    assert list(page.panels) == ["s1", *(f"bad-{case}" for case in MALFORMED_SWEEPS)]
    panel = page.panels["s1"]
    assert not panel.error.visible and panel.figure.visible
    assert panel.figure.title.text == "val_auroc_mean per trial"
    curves = panel.curves.data
    assert curves["trial"] == ["0", "1", "3"]  # the running trial has no epoch yet
    assert curves["xs"] == [[1], [1, 2], [1]] and curves["ys"][:2] == [[0.5], [0.8, 0.95]]
    assert math.isnan(curves["ys"][2][0])  # a gap, not an axis to NaN
    assert curves["dash"] == ["dashed", "solid", "dotted"] and curves["width"] == [1.5, 4.0, 1.5]  # the best thick
    assert panel.ends.data["marker"] == ["x", "circle", "circle"]  # the pruned trial ends with an x
    assert panel.ends.data["text"] == ["#0", "#1", "#3"] and panel.ends.data["x"] == [1, 2, 1]
    for fact in ("val_auroc_mean (maximize)", "1 complete, 1 failed, 1 pruned, 1 running", "#1", "0.95", "lr=0.1"):
        assert fact in panel.facts.text, fact
    table = panel.table.text
    assert table.count("<tr") == 5 and "<tr style='font-weight:bold'><td>#1</td>" in table
    for cell in ("lr=1e-05", "3.2", "run-t1", "TrainingError: boom", ">pruned<", ">running<"):
        assert cell in table, cell
    for case, (_, problem) in MALFORMED_SWEEPS.items():
        bad = page.panels[f"bad-{case}"]
        assert bad.error.visible and bad.figure is None and not bad.table.visible, case
        assert html.escape(problem) in bad.error.text and "The other sweeps are not affected" in bad.error.text

    # the sweep goes on: a trial completes, the page follows
    done = [dict(t) for t in SWEEP["trials"]]
    done[2] |= {"state": "complete", "curve": [0.7, 0.9], "best": 0.9, "epochs": 2}
    events.append((9.0, {"sweep_id": "s1", "status": "done", "trials": done}))
    page.update()
    assert panel.curves.data["trial"] == ["0", "1", "2", "3"] and "done" in panel.facts.text
    assert list(page.grid.children)[0] is page.panels[f"bad-{list(MALFORMED_SWEEPS)[-1]}"].root  # newest first

    empty = SweepsPage(lambda: (0, {}))
    empty.update()
    assert empty.empty.visible and "No sweeps yet" in empty.empty.text


# ---- the routes on a real scheduler --------------------------------------------------------------------------


@pytest.mark.slow
def test_routes_serve_runs_and_survive_malformed_ones():
    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        page = _local(dashboard.install(client))
        assert page.endswith("/dask-dl")
        dashboard.install(client)  # idempotent: a second fit registers again
        client.unregister_scheduler_plugin(dashboard.DashboardPlugin.name)
        dashboard.install(client)  # a new plugin finds the page served already
        servers = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.http_application.applications))
        assert servers == 2  # distributed's Bokeh server and the page's
        history = [{"epoch": 0, "train_loss": 0.7, "val_auroc_mean": 0.61}]
        dashboard.publish(client, "run-a", {"status": "running", "model": "small_cnn", "history": history})
        history = history + [{"epoch": 1, "train_loss": 0.5, "val_auroc_mean": float("nan")}]
        dashboard.publish(client, "run-a", {"status": "finished", "history": history})
        for case, (snapshot, _) in MALFORMED.items():  # what publish refuses, another client may still log
            client.log_event(dashboard.TOPIC, {"run_id": f"bad-{case}", **snapshot})
        client.log_event(dashboard.TOPIC, {"run_id": "bad-bytes", "status": "running", "loss": b"\x00"})
        dashboard.publish(client, "run-b", {"status": "running", "history": []})
        dashboard.publish_sweep(client, "sweep-a", SWEEP)
        client.log_event(dashboard.SWEEP_TOPIC, {"sweep_id": "bad-sweep", "status": "running", "metric": "m"})
        runs = _wait_for(page + "/runs.json", lambda r: "run-b" in r)  # events travel on a batched stream
        assert list(runs) == ["run-a", *(f"bad-{case}" for case in MALFORMED), "bad-bytes", "run-b"]
        assert runs["run-a"] == {
            "status": "finished",
            "model": "small_cnn",  # kept from the first message
            "history": [
                {"epoch": 0, "train_loss": 0.7, "val_auroc_mean": 0.61},
                {"epoch": 1, "train_loss": 0.5, "val_auroc_mean": None},  # NaN is not JSON
            ],
        }
        for case, (_, problem) in MALFORMED.items():
            assert problem in runs[f"bad-{case}"]["problems"][0]
        assert "not a number" in runs["bad-bytes"]["problems"][0]

        assert _get(page)[0] == 200
        texts = _document_texts(page)  # the document the scheduler's Bokeh server made, as a browser gets it
        assert "run-a" in texts and "run-b" in texts
        for case, (_, problem) in MALFORMED.items():
            assert f"bad-{case}" in texts and html.escape(problem) in texts, case
        assert _get(page + "/")[0] == 200  # redirected to /dask-dl
        # the dashboard's menu lists the pages on every page opened after install
        menu = _get(page.replace("/dask-dl", "/status"))[1]
        assert 'href="dask-dl"' in menu and 'href="dask-dl-sweeps"' in menu

        sweeps = _wait_for(page + "/sweeps.json", lambda r: "bad-sweep" in r)
        assert list(sweeps) == ["sweep-a", "bad-sweep"] and sweeps["sweep-a"] == SWEEP
        assert sweeps["bad-sweep"]["problems"] == ["missing key 'trials'"]
        texts = _document_texts(page + "-sweeps")
        assert "sweep-a" in texts and "run-t1" in texts and "missing key &#x27;trials&#x27;" in texts


def test_plugin_keeps_runs_the_event_log_forgot():
    with (
        dask.config.set({"distributed.admin.low-level-log-length": 5}),  # the event log keeps 5 events per topic
        LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        dashboard.publish(client, "early", {"status": "running"})  # before the plugin: it reads the event log
        url = dashboard.install(client)
        dashboard.publish(client, "early", {"status": "finished", "history": [{"epoch": 0, "train_loss": 0.5}]})
        for step in range(10):
            dashboard.publish(client, "late", {"status": "running", "step": step})
        runs = _wait_for(_local(url) + "/runs.json", lambda r: r.get("late", {}).get("step") == 9)
        assert runs == {
            "early": {"status": "finished", "history": [{"epoch": 0, "train_loss": 0.5}]},
            "late": {"status": "running", "step": 9},
        }
        logged = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.get_events(dashboard.TOPIC))
        assert {msg["run_id"] for _, msg in logged} == {"late"}  # the log alone would have lost "early"


def test_scheduler_without_bokeh_dashboard_serves_the_json_only():
    with (
        LocalCluster(
            n_workers=0, processes=False, dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": False}
        ) as cluster,
        Client(cluster) as client,
    ):
        assert dashboard.install(client) is None  # no page to point at
        dashboard.publish(client, "run-a", {"status": "running"})
        runs = _wait_for(_local(client.dashboard_link.replace("/status", "/dask-dl/runs.json")), lambda r: r)
        assert runs == {"run-a": {"status": "running"}}


@pytest.mark.slow
def test_preload_lists_the_page_for_jupyterlab():
    """A scheduler started with the preload serves the page from distributed's own Bokeh server, so its
    /individual-plots.json (what JupyterLab's Dask panel reads) lists it. In a fresh process: the preload
    changes distributed's table of applications for the whole process."""
    script = textwrap.dedent(
        """
        import json, urllib.request
        from urllib.parse import urlparse
        from distributed import Client, LocalCluster
        with (
            LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0",
                         scheduler_kwargs={"preload": ["dask_dl.dashboard.preload"]}) as cluster,
            Client(cluster) as client,
        ):
            base = client.dashboard_link.replace(urlparse(client.dashboard_link).hostname, "127.0.0.1", 1)
            base = base.replace("/status", "")
            get = lambda path: urllib.request.urlopen(base + path, timeout=30).read().decode()
            print(json.dumps({
                "plots": json.loads(get("/individual-plots.json")),
                "menu": get("/status").count('href="dask-dl"'),
                "runs": json.loads(get("/dask-dl/runs.json")),
                "individual": "Dask: dask_dl training runs" in get("/individual-dask-dl"),
                "bokeh_servers": client.run_on_scheduler(
                    lambda dask_scheduler: len(dask_scheduler.http_application.applications)
                ),
                "rendered": rendered(base + "/individual-dask-dl"),
            }))
        """
    )
    script = (
        textwrap.dedent(
            """
            from dask_dl.testing.browser import Browser, find_chromium

            def rendered(url):  # what JupyterLab's panel shows, drawn by a real browser
                if find_chromium() is None:
                    return None
                with Browser() as browser:
                    return browser.open(url).wait_for("text.includes('No runs yet')")
            """
        )
        + script
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["plots"]["Individual Dask Dl"] == "/individual-dask-dl"
    assert found["plots"]["Individual Dask Dl Sweeps"] == "/individual-dask-dl-sweeps"
    assert found["menu"] == 1 and found["runs"] == {} and found["individual"]
    assert found["bokeh_servers"] == 1  # distributed's own serves the page: the plugin added none
    if found["rendered"] is not None:
        assert found["rendered"].splitlines()[:2] == ["dask_dl training runs", "No runs yet: start one with"]


def test_install_lists_the_page_among_jupyterlabs_panels():
    """Without the preload, install() (which fit calls) serves the page from a Bokeh server of its own, and
    /individual-plots.json, the list JupyterLab's Dask panel (dask-labextension) reads, names it beside
    distributed's own pages; the address it names serves the page."""
    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        base = _local(client.dashboard_link).replace("/status", "")
        before = json.loads(_get(base + "/individual-plots.json")[1])
        dashboard.install(client)
        after = json.loads(_get(base + "/individual-plots.json")[1])
        ours = {"Individual Dask Dl": "/individual-dask-dl", "Individual Dask Dl Sweeps": "/individual-dask-dl-sweeps"}
        assert after == {**before, **ours}
        assert "Individual Task Stream" in after  # distributed's own panels stay listed
        status, text = _get(base + after["Individual Dask Dl"])
        assert status == 200 and "Dask: dask_dl training runs" in text
        status, text = _get(base + after["Individual Dask Dl Sweeps"])
        assert status == 200 and "Dask: dask_dl sweeps" in text
        dashboard.install(client)  # every fit installs: still listed once
        assert json.loads(_get(base + "/individual-plots.json")[1]) == after


# ---- a real run in a real browser ----------------------------------------------------------------------------


@pytest.mark.slow  # a real run, watched by headless Chromium
def test_page_in_a_browser_during_and_after_a_real_run(tmp_path):
    """While a real run trains, /dask-dl/runs.json answers with its current history and headless Chromium shows
    its curves; after stop, its status. A malformed run beside it shows its error box only."""
    import dask_dl

    chromium = find_chromium()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        dask_dl.synthesize(tmp_path / "raw", n_images=160, size=64, seed=0)
        dask_dl.ingest(
            dask_dl.read_catalog(tmp_path / "raw"),
            tmp_path / "s.zarr",
            size=32,
            chunk=8,
            shard=2,
            client=client,
            progress=False,
        )
        ds = dask_dl.open_dataset(tmp_path / "s.zarr")
        client.log_event(dashboard.TOPIC, {"run_id": "bad-run", "status": "running", "history": "oops"})
        run = dask_dl.fit(ds, model="small_cnn", epochs=500, batch_size=8, trainers=2, client=client, wait=False)
        page = _local(client.dashboard_link.replace("/status", "/dask-dl"))
        try:
            runs = _wait_for(
                page + "/runs.json", lambda r: len((r.get(run.run_id) or {}).get("history") or []) >= 2, timeout=120
            )
            live = runs[run.run_id]
            assert live["status"] == "running"
            assert live["model"] == "small_cnn" and live["trainers"] == 2
            served = [(row["epoch"], row["train_loss"]) for row in live["history"]]
            ours = list(zip(run.history.epoch, run.history.train_loss, strict=False))[: len(served)]
            assert served == ours  # the page shows this run's own numbers
            if chromium is not None:
                with Browser() as browser:
                    tab = browser.open(page)
                    text = tab.wait_for(f"text.includes('{run.run_id}\\nrunning') && text.includes('per-label AUROC')")
                    tab.screenshot(tmp_path / "during.png")
                    _check_rendered(text, run, status="running")
                    run.stop()  # the open page follows the run, without a reload
                    text = tab.wait_for(f"text.includes('{run.run_id}\\nstopped')")
                    run.wait()
                    tab.screenshot(tmp_path / "after.png")
                    _check_rendered(text, run, status="stopped")
        finally:
            run.stop().wait()
        runs = _wait_for(page + "/runs.json", lambda r: r[run.run_id]["status"] != "running")
        assert runs[run.run_id]["status"] == "stopped"
        if chromium is None:
            unavailable(
                "runs.json checked; the browser part needs Chromium, which is not on PATH "
                "(.ci/run installs Debian's chromium with apt-get; here apt-get is unavailable or failed)"
            )


def _check_rendered(text: str, run, *, status: str) -> None:
    """What BokehJS drew: the run and its status, axis labels, tick values, per-label AUROC bars' values."""
    assert f"{run.run_id}\n{status}" in text
    assert "bad-run\nrunning" in text and "history is 'oops' (str), not a list of epoch rows" in text
    assert "The other runs are not affected." in text
    lines = set(text.splitlines())  # SVG text, each a line (BokehJS's SVG backend draws some twice)
    for label in ("epoch", "loss", "mean AUROC", "AUROC", "train", "validation", "runs side by side"):
        assert label in lines, label
    assert {"0", "0.2", "0.4", "0.6", "0.8", "1"} <= lines  # the AUROC axes' ticks
    shown = int(re.search(r"per-label AUROC, epoch (\d+)", text).group(1))
    row = run.history.set_index("epoch").loc[shown - 1]
    labels = [c.removeprefix("val_auroc_") for c in row.index if c.startswith("val_auroc_") and c != "val_auroc_mean"]
    drawn = [label for label in labels if row[f"val_auroc_{label}"] == row[f"val_auroc_{label}"]]  # not NaN
    assert drawn, "no label has an AUROC on this validation split"
    assert set(labels) <= lines  # the bars' axis
    assert {f"{row[f'val_auroc_{label}']:.3f}" for label in drawn} <= lines  # the bars' values


# ---- the plugin on the scheduler object itself: distributed's async harness ------------------------------------


@gen_cluster(client=True, nthreads=[], config={"dask-dl.dashboard.max-runs": 2})
async def test_plugin_folds_events_on_the_scheduler(c, s):
    """Events logged before the plugin are folded when it starts, later ones as they arrive; the store keeps the
    newest ``max-runs`` runs in start order."""
    from dask_dl.dashboard.events import PLUGIN_NAME, TOPIC
    from dask_dl.dashboard.plugin import DashboardPlugin

    await c.log_event(TOPIC, {"run_id": "a", "status": "running", "step": 1})
    await c.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)
    store = s.plugins[PLUGIN_NAME].store
    assert store.runs == {"a": {"status": "running", "step": 1}}
    await c.log_event(TOPIC, {"run_id": "a", "status": "finished"})
    await c.log_event(TOPIC, {"run_id": "b", "status": "running"})
    await c.log_event(TOPIC, "not a run update")  # skipped, not an error
    await c.log_event(TOPIC, {"run_id": "c", "status": "running"})
    while store.version < 4:
        await asyncio.sleep(0.01)
    assert list(store.runs) == ["b", "c"]  # "a" started first and went when "c" came
    assert store.runs["b"] == {"status": "running"}
