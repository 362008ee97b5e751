"""compression="auto" and the scale-out model it decides with.

The model's formulas against hand-computed figures and its decisions for given figures (no cluster), then real
fits on a LocalCluster of 2 worker processes with real gloo groups: the choice recorded in ``run.info`` and the
history, made once for every rank, following the model for the figures measured, and training like the chosen
compressor named outright.
"""

from __future__ import annotations

import math

import pytest
import torch

import dask_dl
from dask_dl import ConfigurationError
from dask_dl.testing.compression import ALEXNET
from dask_dl.testing.train import fit_squares
from dask_dl.train.compression.model import (
    CPU_CANDIDATES,
    CPU_KERNELS,
    Kernels,
    Link,
    buckets,
    choose,
    exchange_time,
    step_time,
)

FREE = Kernels(add=0, add16=0, div=0, cast=0, quantize=0, decode=0, lowrank=0)  # the network alone
LINK = Link(alpha=1e-4, bandwidth=1e8)  # 100 us a message, 100 MB/s


# ---- the model, by hand ---------------------------------------------------------------------------------------


def test_exchange_times_are_the_collectives_cost_formulas():
    fc = [(1000, 1000)]  # one bucket, 1e6 values, 1000 quantization groups
    # ring all-reduce: 2 (N-1) alpha + 2 (N-1)/N 4e6 / B = 6e-4 + 0.06 (a tree's 4 (alpha + 4e6 / B) is longer)
    assert exchange_time("none", fc, world=4, link=LINK, kernels=FREE) == pytest.approx(0.0606)
    assert exchange_time("bf16", fc, world=4, link=LINK, kernels=FREE) == pytest.approx(6e-4 + 0.03)
    # all-gather of a 125,000 + 8 x 1000 byte message: (N-1) (alpha + 133,000 / B)
    assert exchange_time("onebit", fc, world=4, link=LINK, kernels=FREE) == pytest.approx(3 * (1e-4 + 1.33e-3))
    # all-to-all of 4 stripes of 33,250 bytes, then all-gather of one stripe
    two_stage = 3 * 1e-4 + 0.75 * 4 * 33250 / 1e8 + 3 * (1e-4 + 33250 / 1e8)
    assert exchange_time("onebit2", fc, world=4, link=LINK, kernels=FREE) == pytest.approx(two_stage)
    # the small-message bandwidth, when measured, is the all-gathers' and all-to-alls' (not the all-reduce's)
    gathered = Link(alpha=1e-4, bandwidth=1e8, gather=5e7)
    assert exchange_time("none", fc, world=4, link=gathered, kernels=FREE) == pytest.approx(0.0606)
    assert exchange_time("onebit", fc, world=4, link=gathered, kernels=FREE) == pytest.approx(3 * (1e-4 + 2.66e-3))
    two_stage = 3 * 1e-4 + 0.75 * 4 * 33250 / 5e7 + 3 * (1e-4 + 33250 / 5e7)
    assert exchange_time("onebit2", fc, world=4, link=gathered, kernels=FREE) == pytest.approx(two_stage)
    # and the all-to-alls' own rate, when measured (onebit2's first stage)
    spread = Link(alpha=1e-4, bandwidth=1e8, gather=5e7, all_to_all=2.5e7)
    two_stage = 3 * 1e-4 + 0.75 * 4 * 33250 / 2.5e7 + 3 * (1e-4 + 33250 / 5e7)
    assert exchange_time("onebit2", fc, world=4, link=spread, kernels=FREE) == pytest.approx(two_stage)
    assert exchange_time("onebit", fc, world=4, link=spread, kernels=FREE) == pytest.approx(3 * (1e-4 + 2.66e-3))
    assert Link.from_dict(gathered.to_dict()) == gathered and Link.from_dict(spread.to_dict()) == spread
    # and their seconds per message, fitted by the probe: the all-to-alls take the all-gathers' unless measured
    fitted = Link(alpha=1e-4, bandwidth=1e8, gather=5e7, all_to_all=2.5e7, gather_alpha=3e-4, all_to_all_alpha=2e-4)
    two_stage = 3 * (2e-4 + 33250 / 2.5e7) + 3 * (3e-4 + 33250 / 5e7)
    assert exchange_time("onebit2", fc, world=4, link=fitted, kernels=FREE) == pytest.approx(two_stage)
    assert exchange_time("onebit", fc, world=4, link=fitted, kernels=FREE) == pytest.approx(3 * (3e-4 + 2.66e-3))
    gather_only = Link(alpha=1e-4, bandwidth=1e8, gather=5e7, gather_alpha=3e-4)
    two_stage = 3 * (3e-4 + 33250 / 5e7) * 2
    assert exchange_time("onebit2", fc, world=4, link=gather_only, kernels=FREE) == pytest.approx(two_stage)
    assert Link.from_dict(fitted.to_dict()) == fitted
    # a negative fitted term (a link that lets a burst through faster than its rate) never makes a collective
    # cheaper than alpha a message
    burst = Link(alpha=1e-4, bandwidth=1e8, gather=5e7, gather_alpha=-2e-3)
    assert exchange_time("onebit", fc, world=4, link=burst, kernels=FREE) == pytest.approx(3 * (-2e-3 + 2.66e-3))
    assert exchange_time("onebit", [(100, 100)], world=4, link=burst, kernels=FREE) == pytest.approx(3 * 1e-4)
    assert Link.from_dict({"alpha_s": 1e-4, "bandwidth_bytes_per_s": 1e8}) == LINK  # figures of an older run
    # the kernels: onebit quantizes every value once and decodes N messages of every value
    work = Kernels(add=0, add16=0, div=0, cast=0, quantize=2e-9, decode=1e-9, lowrank=0)
    assert exchange_time("onebit", fc, world=4, link=LINK, kernels=work) == pytest.approx(
        3 * (1e-4 + 1.33e-3) + 1e6 * (2e-9 + 4 * 1e-9)
    )
    # half a core per rank doubles the kernels' time
    half = Kernels(**{**work.to_dict(), "share": 0.5})
    assert exchange_time("onebit", fc, world=4, link=LINK, kernels=half) == pytest.approx(
        3 * (1e-4 + 1.33e-3) + 2e6 * (2e-9 + 4 * 1e-9)
    )


def test_buckets_overlap_the_backward_pass():
    # two 25 MB buckets (6,553,600 values each), half the backward pass each: the first bucket's exchange
    # (0.2 s) runs while the second half of the backward pass (0.1 s) is computed
    shapes = [(6553600,), (6553600,)]
    assert [len(b) for b in buckets(shapes)] == [1, 1]
    link = Link(alpha=0.0, bandwidth=2 * 26214400 / 2 / 0.2)  # 0.2 s per bucket's ring all-reduce on 2 ranks
    compute = 0.3  # forward 0.1 s, backward 0.2 s
    # t: 0.1 forward, 0.2 first half of backward -> exchange 0.2..0.4, second half done 0.3 -> exchange 0.4..0.6
    assert step_time("none", shapes, world=2, link=link, compute_s=compute, kernels=FREE) == pytest.approx(0.6)
    # one rank: no exchange, the step is the compute
    assert step_time("none", shapes, world=1, link=link, compute_s=compute, kernels=FREE) == pytest.approx(0.3)


def test_the_link_carries_one_collective_at_a_time():
    # two buckets of onebit2, no kernels' work: the second bucket's all-to-all (on the trainer's thread) waits for
    # the first bucket's all-gather (on the communication stream) to leave the link
    fc = [(1000, 1000), (1000, 1000)]
    cap = 4_000_000  # one matrix a bucket
    assert [len(b) for b in buckets(fc, cap)] == [1, 1]
    all_to_all = 3 * 1e-4 + 0.75 * 4 * 33250 / 1e8
    all_gather = 3 * (1e-4 + 33250 / 1e8)
    both = step_time("onebit2", fc, world=4, link=LINK, compute_s=0.0, kernels=FREE, cap_bytes=cap)
    assert both == pytest.approx(2 * (all_to_all + all_gather))  # overlapped, it would be 2 all_to_all + 1 gather
    # it waits for the all-gather only, not for the decode that follows it on the communication stream
    decode = Kernels(add=0, add16=0, div=0, cast=0, quantize=0, decode=1e-9, lowrank=0)
    work = 1e6 * 1e-9  # one decode sweep of a bucket: the stripe's (trainer's thread), then the assembly (stream)
    # bucket 1: all-to-all, stripe decode; all-gather, assembly. bucket 2: all-to-all from the end of the first
    # all-gather (before the first assembly ends), stripe decode; all-gather after the first assembly, assembly
    timed = step_time("onebit2", fc, world=4, link=LINK, compute_s=0.0, kernels=decode, cap_bytes=cap)
    assert timed == pytest.approx(2 * (all_to_all + all_gather) + 3 * work)
    # one collective per bucket on the stream (onebit) is unchanged: the stream is the link's order already
    assert step_time("onebit", fc, world=4, link=LINK, compute_s=0.0, kernels=FREE, cap_bytes=cap) == pytest.approx(
        2 * 3 * (1e-4 + 1.33e-3)
    )


def test_choose_for_given_figures():
    kw = dict(compute_s=0.3, kernels=CPU_KERNELS)
    # an AlexNet-sized gradient: 1-bit pays on 1 Gbit/s (two-stage at 16 ranks, where onebit decodes 16 messages)
    # and still on 10 Gbit/s at 2 ranks (as bench/projection.py --auto measured); plain all-reduce on 100 Gbit/s
    assert choose(ALEXNET, world=4, link=Link.gbit(1), **kw).name == "onebit2"
    made = choose(ALEXNET, world=16, link=Link.gbit(1), **kw)
    assert made.name == "onebit2" and made.predicted_s["onebit"] > 2 * made.predicted_s["onebit2"]
    assert choose(ALEXNET, world=4, link=Link.gbit(100), **kw).name == "none"
    assert choose(ALEXNET, world=2, link=Link.gbit(10), **kw).name == "onebit"
    small = [(8, 1, 3, 3), (8,), (2, 8), (2,)]  # latency bound: nothing to save
    assert choose(small, world=4, link=Link.gbit(1), **kw).name == "none"
    assert choose(ALEXNET, world=1, link=None, **kw).name == "none"
    # a candidate earlier in the preference wins when within the margin of the fastest, and says so
    fc = [(1000, 1000)]
    slow = Kernels(add=0, add16=0, div=0, cast=0, quantize=0, decode=0, lowrank=0)
    made = choose(fc, world=4, link=LINK, compute_s=0.0, kernels=slow, candidates=("bf16", "onebit"), margin=10.0)
    assert made.name == "bf16"
    assert made.reason.startswith("bf16 is predicted within 1000% of the fastest, onebit")
    assert set(made.predicted_s) == {"bf16", "onebit"}
    fastest = choose(fc, world=4, link=LINK, compute_s=0.0, kernels=slow, candidates=("bf16", "onebit"))
    assert fastest.name == "onebit" and fastest.reason.startswith("onebit is predicted fastest (onebit 4.3 ms, bf16")
    assert fastest.reason.endswith("; 4 trainers, 0.8 Gbit/s and 100 us per message measured, compute 0.0 ms a step)")
    gathered = choose(fc, world=4, link=Link(alpha=1e-4, bandwidth=1e8, gather=5e7), compute_s=0.0, kernels=slow)
    assert "0.8 Gbit/s (0.4 on 1-4 MB all-gathers) and 100 us per message" in gathered.reason
    spread = Link(alpha=1e-4, bandwidth=1e8, gather=5e7, all_to_all=2.5e7)
    both = choose(fc, world=4, link=spread, compute_s=0.0, kernels=slow)
    assert "0.8 Gbit/s (0.4 on 1-4 MB all-gathers, 0.2 on 1-4 MB all-to-alls) and 100 us per message" in both.reason


def test_model_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, dask_dl.train.compression.model; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_the_probe_fits_a_line_through_two_sizes():
    from dask_dl.train.compression.auto import _line

    sizes = (2**20, 2**22)
    # an all-gather of 4 ranks, (N-1) (a + m / B): 3 messages of the whole input
    times = tuple(3 * (2e-4 + m / 5e7) for m in sizes)
    assert _line(sizes, times, 3, 3, 1e-4) == pytest.approx((5e7, 2e-4))
    # an all-to-all, (N-1) a + (N-1)/N m / B; and a link whose first burst is free (a negative term)
    times = tuple(3 * 2e-4 + 0.75 * m / 2.5e7 for m in sizes)
    assert _line(sizes, times, 0.75, 3, 1e-4) == pytest.approx((2.5e7, 2e-4))
    times = tuple(-3e-3 + 0.75 * m / 2.5e7 for m in sizes)
    assert _line(sizes, times, 0.75, 3, 1e-4) == pytest.approx((2.5e7, -1e-3))
    # the larger input no slower (noise where the ranks' CPU, not the link, is the limit): its rate alone, alpha
    assert _line(sizes, (0.01, 0.01), 3, 3, 1e-4) == pytest.approx((3 * 2**22 / (0.01 - 3e-4), 1e-4))


def test_auto_takes_no_compressor_options(store):
    ds = dask_dl.open_dataset(store)
    with pytest.raises(ConfigurationError, match=r"compression_options=\{'rank': 2\} are one compressor's options"):
        dask_dl.fit(ds, compression="auto", compression_options={"rank": 2}, trainers=2, batch_size=8)


# ---- real fits ---------------------------------------------------------------------------------------------


def test_auto_fit_records_its_choice_and_trains_like_it(store, cluster_client):
    run = fit_squares(store, cluster_client, compression="auto", epochs=2, warmup_steps=0, seed=3)
    assert run.status == "finished"
    made = run.info["compression"]
    figures = made["figures"]
    assert figures["world_size"] == 2 and figures["compute_s"] > 0 and figures["bandwidth_bytes_per_s"] > 0
    assert figures["gather_bytes_per_s"] > 0 and figures["all_to_all_bytes_per_s"] > 0
    assert isinstance(figures["gather_alpha_s"], float) and isinstance(figures["all_to_all_alpha_s"], float)
    # the choice is the model's for the figures measured
    model = dask_dl.build_model("small_cnn", num_outputs=2, in_channels=1, width=8)
    shapes = [tuple(p.shape) for p in model.parameters()]
    predicted = choose(
        shapes,
        world=2,
        link=Link.from_dict(figures),
        compute_s=figures["compute_s"],
        kernels=Kernels(**figures["kernels"]),
        candidates=CPU_CANDIDATES,
    )
    assert made["name"] == predicted.name and made["reason"] == predicted.reason
    assert set(made["predicted_s"]) == {"none", "onebit2", "onebit"}  # CPU trainers: bf16 is left out
    # every epoch's history row says which compressor and why
    assert list(run.history["compression"]) == [made["name"]] * 2
    assert list(run.history["compression_reason"]) == [made["reason"]] * 2
    # every rank used the same compressor: each rank's state in the checkpoint is that compressor's
    ck = run.checkpoint()
    assert [state["name"] for state in ck["compressor"]] == [made["name"]] * 2
    # and the run is the one the chosen compressor gives when named: the probe left no trace
    named = fit_squares(store, cluster_client, compression=made["name"], epochs=2, warmup_steps=0, seed=3)
    assert "compression" not in named.info and "compression" not in named.history
    for k, v in named.checkpoint()["model"].items():
        assert torch.equal(ck["model"][k], v), k
    assert list(named.history["train_loss"]) == list(run.history["train_loss"])


def test_auto_with_one_trainer_is_none_without_a_probe(store, cluster_client):
    run = fit_squares(store, cluster_client, compression="auto", trainers=1)
    assert run.info["compression"] == {"name": "none", "reason": "one trainer: nothing to exchange", "figures": {}}
    assert list(run.history["compression"]) == ["none"]


def test_auto_resumes_with_the_checkpoints_compressor(store, cluster_client, tmp_path):
    ck = str(tmp_path / "ck")
    fit_squares(store, cluster_client, compression="onebit", warmup_steps=0, checkpoint_dir=ck, seed=1)
    resumed = fit_squares(store, cluster_client, compression="auto", epochs=2, checkpoint_dir=ck, resume=True, seed=1)
    assert resumed.info["compression"]["name"] == "onebit"
    assert resumed.info["compression"]["reason"] == "resumed: the checkpoint's compressor is onebit"
    assert math.isfinite(resumed.history["train_loss"].iloc[-1])


def test_cli_takes_auto():
    from dask_dl.cli.train import train_command

    compression = next(p for p in train_command.params if p.name == "compression")
    assert list(compression.type.choices) == ["none", "fp16", "bf16", "powersgd", "onebit", "onebit2", "auto"]
    assert "auto: the compressor the scale-out model predicts fastest" in compression.help


@pytest.mark.slow
def test_the_train_command_says_what_auto_chose_once(store, cluster_client):
    from click.testing import CliRunner

    from dask_dl.cli import cli

    args = ["train", store, "-e", "2", "-q", "--trainers", "2", "--compression", "auto"]
    result = CliRunner().invoke(cli, [*args, "--scheduler", cluster_client.scheduler.address])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if " compression auto chose " in line]
    assert len(said) == 1, result.output
    run_id, _, choice = said[0].partition(": compression auto chose ")
    name, _, reason = choice.partition(": ")
    assert run_id.startswith("fit-") and name in CPU_CANDIDATES
    assert (
        reason.startswith(f"{name} is predicted")
        and "2 trainers" in reason
        and " on 1-4 MB all-gathers, " in reason
        and " on 1-4 MB all-to-alls)" in reason
    )
