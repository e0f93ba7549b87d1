"""Host-side decisions of the Triton path: how kernels are launched and how backward loops are split."""

import torch
import triton
from gemrec.kernels.triton_attention import Problem, launch_hooked


def test_empty_hook_chains_are_not_listeners():
    assert not launch_hooked()


def test_a_registered_launch_hook_is_seen():
    seen = []

    def hook(metadata):
        seen.append(metadata)

    for chain in (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook):
        chain.add(hook)
        try:
            assert launch_hooked()
        finally:
            chain.remove(hook)
        assert not launch_hooked()


def problem(num_seqs, heads, max_q, max_kv, shared_q=False):
    rows_q, rows_kv = (max_q if shared_q else num_seqs * max_q), num_seqs * max_kv
    q = torch.empty(rows_q, heads, 128, device="meta")
    k = torch.empty(rows_kv, heads, 128, device="meta")
    q_off = torch.empty(2 if shared_q else num_seqs + 1, dtype=torch.int64, device="meta")
    kv_off = torch.empty(num_seqs + 1, dtype=torch.int64, device="meta")
    return Problem(q, k, k, q_off, kv_off, max_q, max_kv, 0, False, 0.1, 0, None, None, None, None, None, 128, 2.0)


def test_loops_split_only_where_programs_are_too_few():
    cross = problem(32, 8, 4096, 64)  # 256 dK/dV programs, each over 4096 queries
    assert cross.dkdv_splits() == (8, 512)
    assert cross.dq_splits()[0] == 1
    pma = problem(32, 8, 32, 4096, shared_q=True)  # 256 dQ programs, each over 4096 keys
    assert pma.dq_splits() == (8, 512)
    assert pma.dkdv_splits()[0] == 1
    assert not pma.fuse_dq()  # split dQ comes from the dQ kernel, not from atomics
    long_self = problem(32, 8, 4096, 4096)  # thousands of programs already
    assert long_self.dkdv_splits()[0] == long_self.dq_splits()[0] == 1
    assert long_self.fuse_dq()
    uneven = problem(2, 2, 1000, 1000)
    splits, split_len = uneven.dkdv_splits()
    assert splits > 1 and split_len % 256 == 0 and (splits - 1) * split_len < 1000 <= splits * split_len
