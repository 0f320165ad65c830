"""Flat host buffers in huge pages (megalite.optim.host_pages): aligned, the right size and values,
advised before the first write, and plain tensors wherever the advice does not apply."""
import copy
import os
import re
import sys

import pytest
import torch

from megalite.optim import host_pages
from megalite.optim.buffers import ParamAndGradBuffer


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_a_large_flat_buffer_starts_on_a_huge_page_and_is_advised_before_its_first_write(monkeypatch):
    calls = []
    real = host_pages._madvise()
    monkeypatch.setattr(host_pages, "_madvise", lambda: lambda a, n, f: calls.append((a, n, f)) or real(a, n, f))
    t = host_pages.zeros_flat(3 * (1 << 20) + 5, torch.float32, "cpu")
    assert t.numel() == 3 * (1 << 20) + 5 and t.is_contiguous() and not t.any()
    assert t.data_ptr() % host_pages.HUGE_PAGE == 0
    (addr, length, flag), = calls
    assert addr == t.data_ptr() and flag == 14
    # The advice covers the whole buffer and nothing past its allocation.
    storage = t.untyped_storage()
    assert t.numel() * 4 <= length <= storage.data_ptr() + storage.nbytes() - addr
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


def _vm_flags_at(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_the_kernel_holds_a_large_buffer_as_advised_huge():
    """The kernel marks the buffer's mapping VM_HUGEPAGE ("hg"), so it backs it with huge pages where
    it has free ones. (Counting AnonHugePages instead failed on a host whose huge pages were all in
    use at that moment: whether any are free is the machine's, not megalite's.)"""
    t = host_pages.zeros_flat(1 << 22, torch.float32, "cpu")  # 16 MiB
    assert "hg" in _vm_flags_at(t.data_ptr()), _vm_flags_at(t.data_ptr())
    assert not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.skipif(bool(os.environ.get("THP_MEM_ALLOC_ENABLE")), reason="PyTorch's switch advises every large allocation")
def test_the_advice_goes_with_the_buffer_and_never_reaches_later_allocations():
    """Each buffer is its own mapping, unmapped when freed. Carved from the allocator's heap (as once),
    the advice stayed on the heap after the buffer was freed and a later plain tensor there was huge
    too: CI caught it when a test ran after others had freed their buffers, the heap's glibc mmap
    threshold having risen past 16 MiB."""
    for _ in range(8):  # frees of large plain blocks raise glibc's mmap threshold; then buffers come and go
        plain = torch.empty(1 << 23)
        del plain
        buffer = host_pages.zeros_flat(1 << 22, torch.float32, "cpu")
        address = buffer.data_ptr()
        view = buffer[10:20]
        del buffer
        assert "hg" in _vm_flags_at(address)  # a view keeps the mapping
        del view
        assert _vm_flags_at(address) == set()  # unmapped with its last tensor
    later = [torch.zeros(1 << 22) for _ in range(8)]
    assert ["hg" in _vm_flags_at(t.data_ptr()) for t in later] == [False] * 8


def test_small_buffers_and_other_devices_are_plain_tensors():
    assert not host_pages.huge_pages_apply("cpu", host_pages.HUGE_PAGE - 1)
    assert not host_pages.huge_pages_apply("meta", 1 << 30)
    small = host_pages.zeros_flat(1000, torch.bfloat16, "cpu")
    assert small.numel() == 1000 and small.untyped_storage().nbytes() == 2000 and not small.any()
    meta = host_pages.empty_flat(1 << 24, torch.float32, "meta")
    assert meta.is_meta and meta.numel() == 1 << 24


def test_the_gradient_buffers_parameters_and_gradients_are_views_of_aligned_flat_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    want = [p.detach().clone() for p in model.parameters()]
    twin = copy.deepcopy(model)
    x = torch.randn(4, 1024)
    twin(x).sum().backward()
    buf = ParamAndGradBuffer(list(model.parameters()), param_dtype=torch.float32, grad_dtype=torch.float32,
                             bucket_numel=1 << 30, dp_group=None, dp_size=1, reduce_scatter=False)
    assert [torch.equal(p, w) for p, w in zip(model.parameters(), want)] == [True] * len(want)
    if sys.platform.startswith("linux"):
        assert buf.param_data.data_ptr() % host_pages.HUGE_PAGE == 0
        assert buf.grad_data.data_ptr() % host_pages.HUGE_PAGE == 0
    model(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.grad is p.main_grad and torch.equal(p.main_grad, q.grad)
        assert p.main_grad.untyped_storage().data_ptr() == buf.grad_data.untyped_storage().data_ptr()
