"""The launch path choice: compiled kernels are launched directly unless something listens to launches."""

import triton
from gemrec.kernels.triton_attention import launch_hooked


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
