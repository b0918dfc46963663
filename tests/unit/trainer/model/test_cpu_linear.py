"""CPU linears through oneDNN (rlx.trainer.model.cpu_linear): the same products and gradients as
nn.Linear's within float32 rounding, models that keep their parameters and checkpoints, and
BLAS wherever it is asked for; the choice between them follows the CPU's features, never a
timing, so load cannot change it. The product tests fix the choice (RLX_CPU_LINEAR), so the
oneDNN path is the one tested whichever this CPU would take."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from rlx.trainer.model import cpu_linear
from rlx.trainer.model.cpu_linear import OneDNNLinear, linear, use_onednn

# float32 products summed in another order: a few units of float32's resolution relative
# to the largest entry (measured 2e-7 to 8e-7 here); a wrong transpose or a missing term
# is off by order one.
RELATIVE = 1e-5

needs_onednn = pytest.mark.skipif(
    cpu_linear._product() is None, reason="this torch has no oneDNN linear"
)


def with_choice(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(cpu_linear.ENV, value)
    cpu_linear.decision.cache_clear()


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with_choice(monkeypatch, "onednn")
    assert cpu_linear.choice() == "onednn"
    yield
    cpu_linear.decision.cache_clear()


@pytest.fixture
def blas(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with_choice(monkeypatch, "blas")
    yield
    cpu_linear.decision.cache_clear()


def relative_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def gradients(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad.clone(), **grads}


@needs_onednn
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_products_and_gradients_equal_nn_linears(onednn: None, bias: bool, layout: str) -> None:
    generator = torch.Generator().manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias)
    turned = copy.deepcopy(plain)
    assert use_onednn(turned) == 1 and type(turned) is OneDNNLinear
    x = torch.randn(3, 37, 48, generator=generator)
    if layout == "transposed":  # strided input, as an attention output's view can be
        x = torch.randn(3, 48, 37, generator=generator).transpose(1, 2)
    grad = torch.randn(3, 37, 80, generator=generator)
    want, got = gradients(plain, x, grad), gradients(turned, x, grad)
    assert set(got) == set(want)
    for name in want:
        assert relative_gap(got[name], want[name]) <= RELATIVE, name


@needs_onednn
def test_what_onednn_does_not_take_runs_as_nn_linear(onednn: None) -> None:
    """float64 (and autocast) go through F.linear: the very same numbers."""
    layer = nn.Linear(16, 8).double()
    use_onednn(layer)
    x = torch.randn(5, 16, dtype=torch.float64)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    single = nn.Linear(16, 8)
    use_onednn(single)
    y = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = single(y)
    assert out.dtype == torch.bfloat16  # autocast applied, as nn.Linear's forward gets it


@needs_onednn
def test_the_head_product_runs_like_the_layers(onednn: None) -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 32, generator=generator, requires_grad=True)
    weight = torch.randn(50, 32, generator=generator, requires_grad=True)
    grad = torch.randn(20, 50, generator=generator)
    got = linear(hidden, weight)
    got.backward(grad)
    got_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = nn.functional.linear(hidden, weight)
    want.backward(grad)
    assert relative_gap(got, want) <= RELATIVE
    assert relative_gap(got_grads[0], hidden.grad) <= RELATIVE
    assert relative_gap(got_grads[1], weight.grad) <= RELATIVE


@needs_onednn
def test_a_turned_model_keeps_its_parameters_and_checkpoint(
    onednn: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = copy.deepcopy(plain)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    turned = use_onednn(model)
    assert turned == sum(type(m) is OneDNNLinear for m in model.modules()) > 0
    assert all(isinstance(m, nn.Linear) for m in model.modules() if type(m) is OneDNNLinear)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    ids = torch.tensor([[256, 72, 105, 33, 10, 99]])
    with torch.no_grad():
        assert relative_gap(model(ids).logits, plain(ids).logits) <= RELATIVE
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert all(type(m) is not OneDNNLinear for m in reloaded.modules())  # nothing saved of it
    assert all(torch.equal(t, before[n]) for n, t in reloaded.state_dict().items())
    assert use_onednn(copy.deepcopy(model)) == 0  # a copy is turned already


def test_blas_leaves_models_as_they_are(blas: None) -> None:
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert use_onednn(layer) == 0
    assert all(type(m) is nn.Linear for m in layer)
    assert cpu_linear.describe() == "cpu linears: BLAS (RLX_CPU_LINEAR set)"


def test_a_setting_it_does_not_know_says_what_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    with_choice(monkeypatch, "fastest")
    with pytest.raises(ValueError, match="RLX_CPU_LINEAR='fastest': use one of auto, onednn, blas"):
        cpu_linear.choice()
    cpu_linear.decision.cache_clear()


def with_features(
    monkeypatch: pytest.MonkeyPatch, capability: str, cap: str | None = None
) -> cpu_linear.Decision:
    """The decision `auto` makes on a CPU that torch reads as `capability`, with oneDNN's
    ISA cap `cap`; any timing on the way fails the test."""
    with_choice(monkeypatch, "auto")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    for name in cpu_linear.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    if cap is not None:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)

    def no_timing() -> float:
        raise AssertionError("the choice timed something")

    monkeypatch.setattr(time, "perf_counter", no_timing)
    try:
        return cpu_linear.decision()
    finally:
        cpu_linear.decision.cache_clear()


@needs_onednn
@pytest.mark.parametrize(
    ("capability", "cap", "taken"),
    [
        ("AVX512", None, "onednn"),
        ("AVX512", "AVX512_CORE", "onednn"),
        ("AVX512", "all", "onednn"),
        ("AVX512", "AVX2", "blas"),  # the cap that stands in for an AVX2-only machine
        ("AVX2", None, "blas"),
        ("AVX2", "ALL", "blas"),
        ("DEFAULT", None, "blas"),
    ],
)
def test_auto_follows_the_cpus_features_not_a_timing(
    monkeypatch: pytest.MonkeyPatch, capability: str, cap: str | None, taken: str
) -> None:
    got = with_features(monkeypatch, capability, cap)
    assert got.taken == taken
    if taken == "blas":
        assert "RLX_CPU_LINEAR=onednn takes oneDNN" in got.reason
        assert ("ONEDNN_MAX_CPU_ISA=AVX2" in got.reason) == (cap == "AVX2")
    else:
        assert got.reason == "this CPU has AVX-512; RLX_CPU_LINEAR=blas keeps BLAS"


@needs_onednn
def test_the_setting_overrides_the_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with_choice(monkeypatch, "onednn")
    assert cpu_linear.describe() == "cpu linears: oneDNN (RLX_CPU_LINEAR set)"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with_choice(monkeypatch, "blas")
    assert cpu_linear.describe() == "cpu linears: BLAS (RLX_CPU_LINEAR set)"
    cpu_linear.decision.cache_clear()


def _busy(stop: threading.Event) -> None:
    a = torch.randn(384, 384)
    while not stop.is_set():
        a @ a  # torch leaves the GIL while it multiplies: a core's worth of load per thread


def test_a_loaded_cpu_does_not_change_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided again and again while two threads keep the cores busy (where the old
    start-up timing took oneDNN in 3-8 of 30 tries on a 2-core AVX2 CPU under two busy
    processes), the choice is the one the CPU's features give, every time; the timed figure
    may move, it decides nothing."""
    with_choice(monkeypatch, "auto")
    quiet = cpu_linear.decision()
    wide, _ = cpu_linear.avx512_for_onednn()
    if cpu_linear._product() is not None:
        assert quiet.taken == ("onednn" if wide else "blas")
    stop = threading.Event()
    loads = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(2)]
    for load in loads:
        load.start()
    try:
        taken, speeds = set(), []
        for _ in range(20):
            cpu_linear.decision.cache_clear()
            taken.add(cpu_linear.decision())
            speeds.append(cpu_linear.measured_speed())  # what a start-up timing met
    finally:
        stop.set()
        for load in loads:
            load.join(10)
        cpu_linear.decision.cache_clear()
    assert taken == {quiet}, speeds


def test_the_run_logs_what_it_took_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """One line, the same in every process of a machine: a resume there takes it again."""
    with_choice(monkeypatch, "auto")
    line = cpu_linear.describe()
    taken = cpu_linear.decision()
    cpu_linear.decision.cache_clear()
    assert cpu_linear.describe() == line  # decided afresh, as a resumed process does
    assert line.startswith(f"cpu linears: {'oneDNN' if taken.taken == 'onednn' else 'BLAS'} (")
    assert taken.reason in line and "\n" not in line and "measured" not in line
    speed = cpu_linear.measured_speed()  # the optional figure
    assert speed is None if cpu_linear._product() is None else speed > 0
    cpu_linear.decision.cache_clear()
