"""device.limit_shared_memory (CPU, no GPU): the planners see the capped opt-in inside, the
launch caches registered with when_limit_changes are dropped on entry and exit, bad limits are
refused."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from cupyflash.gpu import device  # noqa: E402


@pytest.fixture
def fake_device(monkeypatch):
    """Device 7: compute capability 9.0, 227 KB opt-in, 132 SMs (no GPU needed)."""
    monkeypatch.setitem(device._device_info, 7, (90, 232448, 132))
    monkeypatch.setattr(device, "_on_limit_change", [])
    return 7


def test_info_is_capped_inside_and_restored_after(fake_device):
    assert device.info(fake_device) == (90, 232448, 132)
    with device.limit_shared_memory(99 * 1024):
        assert device.info(fake_device) == (90, 101376, 132)
        with device.limit_shared_memory(300 * 1024):   # above the device's own: no change
            assert device.info(fake_device) == (90, 232448, 132)
        assert device.info(fake_device) == (90, 101376, 132)
    assert device.info(fake_device) == (90, 232448, 132)


def test_registered_caches_are_cleared_on_entry_and_exit(fake_device):
    cache = {"planned": 1}
    device.when_limit_changes(cache.clear)
    device.when_limit_changes(cache.clear)          # registered once
    assert device._on_limit_change == [cache.clear]
    with device.limit_shared_memory(99 * 1024):
        assert cache == {}
        cache["planned under 99 KB"] = 2
    assert cache == {}


@pytest.mark.parametrize("bad", [0, -5, 99.5, True, "99k"], ids=repr)
def test_bad_limit_is_refused(fake_device, bad):
    with pytest.raises(ValueError, match="^nbytes: got"):
        with device.limit_shared_memory(bad):
            pass
    assert device.info(fake_device)[1] == 232448
