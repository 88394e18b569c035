"""stats(model)["memory"]: the process's RSS split by holder, each holder's figure exact."""

import torch
from helpers import gpt_step

import tieroffload
from tieroffload.testing.models import GPT
from tieroffload.utils import memory

MiB = 1 << 20


def _train(model, opt, steps=2):
    for i in range(steps):
        gpt_step(model, opt, i)


def test_memory_parts_sum_to_rss_and_name_the_state_in_ram():
    torch.manual_seed(0)
    model = GPT(97, 64, 3, 4, 16)
    n = sum(p.numel() for p in model.parameters())
    tieroffload.offload(model, tieroffload.Policy(params="cpu", device="cpu"))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    _train(model, opt)
    m = tieroffload.stats(model)["memory"]
    assert sum(v for k, v in m.items() if k != "rss") == m["rss"]
    assert m["params"] == 4 * n
    # Adam's two moments, fp32, and a 4-byte step count per parameter tensor.
    assert m["optimizer"] == 8 * n + 4 * len(list(model.parameters()))
    assert m["grads"] == 0 and m["staging"] == 0
    opt.close()
    tieroffload.close(model)


def test_memory_on_nvme_holds_the_budget_and_a_chunk_at_most(tmp_path):
    torch.manual_seed(0)
    model = GPT(97, 64, 4, 4, 16)
    budget = 96 << 10
    tieroffload.offload(model, tieroffload.Policy(
        params="nvme", optimizer="nvme", grads="nvme", nvme_dir=str(tmp_path), device="cpu",
        cpu_budget=budget))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    _train(model, opt)
    st = tieroffload.stats(model)
    m = st["memory"]
    largest = max(4 * p.numel() for p in model.parameters())
    pages = len(list(model.modules())) * memory.PAGE  # each unit's buffer ends on a page
    assert 0 < m["params"] <= st["resident"] + pages and st["resident"] <= budget
    # The optimizer keeps a chunk's pages for the next chunk read.
    assert m["params"] + m["parked"] <= budget + pages + 3 * largest
    assert m["optimizer"] <= 3 * largest  # written out, kept for the next chunk at most
    assert m["staging"] <= st["overhead"]
    opt.close()
    tieroffload.close(model, restore=False)


def test_memory_counts_a_tensor_the_user_fills_under_tensors(tmp_path):
    model = GPT(97, 64, 2, 4, 16)
    tieroffload.offload(model, tieroffload.Policy(params="cpu", device="cpu"))
    before = tieroffload.stats(model)["memory"]
    t = torch.ones(64 * MiB, dtype=torch.uint8)
    after = tieroffload.stats(model)["memory"]
    # "tensors" is malloc's bytes in use less what units hold: what else the process frees
    # between the two samples comes off it (a CI run measured 64 MiB less 25 KiB).
    assert after["tensors"] - before["tensors"] >= 63 * MiB
    assert abs(after["other"] - before["other"]) < 8 * MiB
    assert after["rss"] - before["rss"] >= 60 * MiB
    del t
    tieroffload.close(model)


def test_offloading_to_nvme_gives_back_the_ram_of_parameters_built_in_the_heap(tmp_path):
    """Parameters under glibc's mmap threshold are carved from its heap, which keeps their
    pages when they are freed: offload hands them back once they are on their way home."""
    memory.return_freed_memory()  # the threshold fixed: 256 KiB, over each parameter here
    memory.trim_heap()
    before = memory.rss()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(240, 240, bias=False) for _ in range(1024)))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # 225 MiB
    assert memory.rss() - before >= nbytes * 9 // 10
    x = torch.randn(2, 240)
    with torch.no_grad():
        want = model(x)
    tieroffload.offload(model, tieroffload.Policy(
        params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget="1MiB"))
    held = memory.rss() - before
    assert held <= nbytes // 2, (held, nbytes)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    tieroffload.close(model, restore=False)


def test_resident_bytes_counts_only_pages_touched():
    from tieroffload import aio
    buf = aio.aligned_empty(16 * memory.PAGE, pin=False)
    assert memory.resident_bytes([(buf.data_ptr(), buf.numel())]) == 0
    buf[: 3 * memory.PAGE].fill_(1)
    assert memory.resident_bytes([(buf.data_ptr(), buf.numel())]) == 3 * memory.PAGE
    assert memory.resident_bytes([(buf.data_ptr() + 1, 10)]) == 0  # unaligned: not asked
