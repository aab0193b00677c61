"""The batched pass's plan (specfleet/engine/attention.py): what it costs on the device the model runs on.

On a GPU each tensor operation on the device is a kernel launch or a copy, some microseconds of the host's time: a
plan whose operations grow with its sessions costs a pass of 64 sessions more than its layers do. The plans here are
built for the meta device, which runs no arithmetic, and every operation whose result lies there is counted.
"""

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specfleet.engine import attention


class DeviceOps(TorchDispatchMode):
    """Counts the operations whose results lie on `device`."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.count = device, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += any(isinstance(t, torch.Tensor) and t.device == self.device for t in tree_leaves(out))
        return out


def _plan_ops(sessions: int) -> int:
    """Device operations of one batched plan for `sessions` sessions: chains of 1 and 3 tokens and a tree, each
    session's blocks consecutive (a range of the pool's token axis), as the verifier's passes have them."""
    model = SimpleNamespace(device=torch.device("meta"), dtype=torch.bfloat16)
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    new_lens = [(1, 3, 3)[b % 3] for b in range(sessions)]
    attends = [(None, torch.ones(3, 3, dtype=torch.bool).tril(), tree)[b % 3] for b in range(sessions)]
    kv_lens = [20 + b for b in range(sessions)]
    places = [64 * (b + 1) for b in range(sessions)]
    with DeviceOps(model.device) as ops:
        plan = attention.batch_plan(model, places, kv_lens, new_lens, attends, width=3)
    assert plan.bias.shape == (sessions, 1, 3, max(k + n for k, n in zip(kv_lens, new_lens)))
    return ops.count


def test_a_batched_plan_costs_the_device_as_many_operations_at_48_sessions_as_at_3():
    assert _plan_ops(48) == _plan_ops(3)


def test_a_plan_reads_each_session_where_it_lies_and_masks_the_rest():
    """The plan's read index and mask on a CPU: a range, a session of scattered blocks, and a padding row."""
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    scattered = torch.tensor([40, 41, 8, 9, 10])
    plan = attention.batch_plan(model, [16, scattered], [2, 3], [1, 2], [None, torch.ones(2, 2, dtype=torch.bool).tril()], 2)
    assert plan.read_index.tolist() == [[16, 17, 18, 0, 0], [40, 41, 8, 9, 10]]
    assert plan.write_index.tolist() == [18, 9, 10] and plan.write_b.tolist() == [0, 1, 1] and plan.write_j.tolist() == [0, 0, 1]
    visible = (plan.bias[:, 0] == 0).tolist()
    assert visible[0] == [[True, True, True, False, False], [True, True, False, False, False]]  # row 1 pads: the prefix
    assert visible[1] == [[True, True, True, True, False], [True, True, True, True, True]]
