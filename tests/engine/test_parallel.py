"""Tensor parallelism (specfleet/engine/parallel.py) between CPU processes: a model split over 2 and 4
ranks gives the single process's logits, for every supported family, over chains, trees and ragged batches,
with sessions that grow, move and roll back (the KV copies rank 0 makes, which the others replay)."""

from __future__ import annotations

import pytest
import torch

from specfleet.engine import ForwardItem, Session, forward_batch, load_model, prefill
from specfleet.engine import parallel
from tests.engine.test_llama import BLOCK, DEVICE, FAMILIES, _configs, _save

TOLERANCE = dict(atol=2e-4, rtol=1e-4)


def _passes(loaded) -> list[torch.Tensor]:
    """Every logit of a fixed sequence of passes: prefill, a ragged batch of a chain, a tree and a decode step,
    a tree's accepted path kept (a KV copy) and continued, and a session grown past its neighbour (a move)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (9, 4, 70)]
    a, b, c = (Session(token_ids=list(p)) for p in prompts)
    out = [torch.tensor(prefill(loaded, [a, b, c], keep_last=1, score=True))]
    attend = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    ra, rb, rc = (len(p) - 1 for p in prompts)
    items = [
        ForwardItem(a, [prompts[0][-1], 11, 12, 13], list(range(ra, ra + 4))),
        ForwardItem(b, [prompts[1][-1], 21, 22, 23, 24], [rb, rb + 1, rb + 2, rb + 2, rb + 1], attend),
        ForwardItem(c, [prompts[2][-1]], [rc]),
    ]
    logits = forward_batch(loaded, items)
    out += [logits[0, :4], logits[1, :5], logits[2, :1]]
    b.commit([0, 1, 3])  # the path root -> 21 -> 23: a copy within b's blocks
    b.token_ids += [21, 23]
    out.append(forward_batch(loaded, [ForwardItem(b, [31], [len(b.token_ids)])])[0, :1])
    b.commit([0])
    b.token_ids.append(31)
    # a grows with the block after its last one taken: on a CPU's pool it moves (a copy of its cache).
    a.truncate(len(prompts[0]))
    if loaded.pool.free_after(a.blocks[-1], 1):
        loaded.pool.take([a.blocks[-1] + 1])
    grow = torch.randint(0, 8192, (100,), generator=gen).tolist()
    a.token_ids += grow
    logits = forward_batch(loaded, [ForwardItem(a, [prompts[0][-1], *grow], list(range(ra, ra + 101))), ForwardItem(b, [31], [len(b.token_ids) - 1])])
    out += [logits[0, :101], logits[1, :1]]
    return out


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_split_model_gives_the_single_process_logits(tmp_path, name, size):
    _save(tmp_path, _configs()[name], name)
    whole = load_model(name, tmp_path / name, kv_block_size=BLOCK)
    whole.prepare(1 << 30, 64)
    expected = _passes(whole)
    split = load_model(name, tmp_path / name, kv_block_size=BLOCK, tensor_parallel_size=size)
    try:
        split.prepare(1 << 30, 64)
        assert split.model.heads == whole.model.heads // size and split.model.lm_head.shape[0] == -(-8192 // size)
        got = _passes(split)
        assert split.pool.relocations > 0  # the move was made, and replayed by the other ranks
    finally:
        split.close()
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, **TOLERANCE)


@pytest.mark.parametrize("collectives", parallel.CPU_COLLECTIVES)
@pytest.mark.parametrize("attention", ["batched", "per-session"])
def test_a_split_model_attends_either_way(tmp_path, monkeypatch, attention, collectives):
    """Batched attention (a GPU's auto) gathers every rank's sessions through their block tables; the collectives
    run through shared memory or on torch.distributed (gloo here, NCCL's calls on a GPU)."""
    monkeypatch.setenv("SPECFLEET_TP_CPU_COLLECTIVES", collectives)
    _save(tmp_path, _configs()["llama-gqa"], "m")
    whole = load_model("m", tmp_path / "m", kv_block_size=BLOCK, attention=attention)
    expected = _passes(whole)
    split = load_model("m", tmp_path / "m", kv_block_size=BLOCK, attention=attention, tensor_parallel_size=2)
    try:
        assert split.model.parallel.distributed == (collectives == "gloo")
        got = _passes(split)
    finally:
        split.close()
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, **TOLERANCE)


def test_one_rank_runs_the_split_path_on_the_test_device(tmp_path):
    """N = 1 through a split model's code path on the tests' device (SPECFLEET_TEST_DEVICE): every collective on
    torch.distributed (gloo on a CPU; on the GPU check's one GPU, NCCL, inside CUDA graphs too) gives the unsplit
    model's logits."""
    from tests.engine.test_llama import TOLERANCE as DEVICE_TOLERANCE

    _save(tmp_path, _configs()["llama-gqa"], "m")
    sizes = [[1, 1], [3, 8]]  # on a GPU, graphs for the passes of `_passes` that fit them
    whole = load_model("m", tmp_path / "m", device=DEVICE, kv_block_size=BLOCK, cuda_graph_sizes=sizes)
    whole.prepare(1 << 30, 64)
    expected = _passes(whole)
    alone = load_model("m", tmp_path / "m", device=DEVICE, kv_block_size=BLOCK, cuda_graph_sizes=sizes, group=parallel.alone(torch.device(DEVICE)))
    try:
        alone.prepare(1 << 30, 64)
        assert alone.model.parallel.distributed and alone.model.parallel.size == 1
        got = _passes(alone)
        if DEVICE.startswith("cuda"):
            assert alone.graphs is not None and alone.graphs._graphs, "no pass replayed a CUDA graph"
    finally:
        alone.close()
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine.cpu(), theirs.cpu(), **DEVICE_TOLERANCE)


def test_heads_that_do_not_split_are_refused_naming_the_setting(tmp_path):
    _save(tmp_path, _configs()["llama-gqa"], "m")  # 4 attention heads, 2 key/value heads, intermediate size 96
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split the model: it must divide its 4 attention heads"):
        load_model("m", tmp_path / "m", tensor_parallel_size=3)


def test_key_value_heads_are_shared_out_or_replicated():
    assert [parallel.kv_heads_of(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Fewer than ranks: query heads [r H / 4, (r + 1) H / 4) read key/value head r KV / 4.
    assert [parallel.kv_heads_of(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_a_failed_load_on_rank_0_ends_its_ranks_and_leaves_no_shared_memory(tmp_path, monkeypatch):
    """Rank 0 fails to read its weights after starting the others (which wait for it): they are ended and its
    /dev/shm file is removed, so a failed start leaves nothing behind; the error is the load's own."""
    import glob
    import os

    from specfleet.engine import loading

    _save(tmp_path, _configs()["llama-gqa"], "m")
    started = []
    real_launch = parallel.launch

    def launch(*args, **kwargs):
        group = real_launch(*args, **kwargs)
        started.extend(group.workers)
        return group

    def unreadable(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(parallel, "launch", launch)
    monkeypatch.setattr(loading, "_read_weights", unreadable)
    with pytest.raises(OSError, match="disk gone"):
        load_model("m", tmp_path / "m", tensor_parallel_size=2)
    [rank] = started
    assert rank.wait(timeout=30) != 0  # ended, not stopped
    assert not glob.glob(f"/dev/shm/specfleet-tp-{os.getpid()}-*")


def test_a_rank_whose_rank_0_died_before_it_started_watching_exits():
    """Rank 0 killed right after starting a rank (before the rank's watch began): the rank's parent is then another
    process, and the rank must not take that one for rank 0 and wait for its group forever."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    spec = '{"rank": 1, "size": 2, "where": {"shm": "/dev/shm/specfleet-tp-never", "port": 1}, "threads": 1, "device": "cpu"}'
    rank = subprocess.Popen([sys.executable, "-c", parallel._RANK_MAIN, spec, str(gone.pid)], stderr=subprocess.DEVNULL)
    try:
        assert rank.wait(timeout=30) == 0
    finally:
        rank.kill()
