"""Every Triton kernel larql launches compiles for a GPU (sm_90), from a CPU machine.

The kernel tests run in Triton's interpreter here, which runs a kernel's Python and not its
compiler. This runs a sample of them again with their launches noted (`kernel_compile`) — each
kernel in the shapes the tests give it, the decode step's kernels through the real model's
kernel path — and compiles each distinct launch for sm_90, as a CUDA machine's first launch
would, the attention launches also as a bfloat16 model's (with turbo-quant's PTX code lookup).
On a CUDA machine the kernel tests compile their launches themselves: this skips."""

from __future__ import annotations

import pytest
import torch

import test_argmax_kernel as argmax_tests
import test_decode_attention_kernel as attention_tests
import test_elementwise_kernels as elementwise_tests
import test_gemv_kernels as gemv_tests
import test_kv_quant_kernels as kv_quant_tests
import test_static_batching as batching_tests
import test_turbo_quant_batching as turbo_batching_tests
import test_turbo_quant_kernels as turbo_tests
from helpers import kernel_module
from kernel_compile import Launch, compile_failures, recorded
from larql.kv.turbo_quant.codebook import codebook
from larql.models import Model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel tests compile on CUDA"),
]


def _attention_launches() -> None:
    kernels = kernel_module("larql.kernels.decode_attention")
    for shape in attention_tests.SHAPES:
        attention_tests.test_kernel_equals_float64_attention(kernels, shape, torch.float16)
    attention_tests.test_the_last_split_of_each_head_merges_and_leaves_the_counts_at_zero(kernels)


def _product_launches() -> None:
    gemv = kernel_module("larql.kernels.gemv")

    def own_blocks(blocks: object) -> object:
        return gemv

    for dtype in (torch.float32, torch.bfloat16):
        for n, k, _ in gemv_tests.SHAPES[:3]:
            gemv_tests.test_normed_product_equals_norm_then_linear(
                own_blocks, dtype, n, k, None, True
            )
            gemv_tests.test_residual_product_equals_linear_then_add(own_blocks, dtype, n, k, None)
            gemv_tests.test_gated_product_equals_silu_times_up_then_linear_then_add(
                own_blocks, dtype, n, k, None
            )
        gemv_tests.test_normed_product_with_rope_equals_norm_linear_then_rope(
            own_blocks, dtype, 576, None, False
        )
        gemv_tests.test_the_product_with_rope_stores_k_and_v_at_the_position(own_blocks, dtype)


def _elementwise_launches() -> None:
    argmax_rows = kernel_module("larql.kernels.argmax").argmax_rows
    for dtype in (torch.float32, torch.bfloat16):
        elementwise_tests.test_rope_in_one_launch_equals_torchs(dtype, 64, 64)
        elementwise_tests.test_silu_times_up_in_one_launch_equals_torchs(dtype, 1536)
        argmax_tests.test_random_rows_pick_torch_argmax(argmax_rows, dtype, 5000)
    elementwise_tests.test_rms_norm_in_one_launch_equals_torchs(torch.bfloat16, (3, 576))
    elementwise_tests.test_store_row_writes_k_and_v_at_the_position_and_nothing_else(64)


def _coded_launches() -> None:
    turbo = kernel_module("larql.kv.turbo_quant.kernels")
    for case in turbo_tests.ATTENTION_CASES:
        turbo_tests.test_attention_equals_float64_over_the_stored_rows_and_stores_the_new_one(
            turbo, *case
        )
    turbo_batching_tests.test_the_batched_launch_is_each_sessions_own_launch(turbo)
    kv_quant = kernel_module("larql.kv.kv_quant.kernels")
    for case in kv_quant_tests.ATTENTION_CASES:
        kv_quant_tests.test_attention_over_the_codes_equals_float64_over_the_decoded_rows(
            kv_quant, *case
        )


# the parameters that carry the model's dtype, where a launch has them
MODEL_DTYPE = {
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "anchor_ptr",
    "out_ptr",
    "k_new_ptr",
    "v_new_ptr",
    "exact_ptr",
}


def in_bfloat16(launch: Launch) -> Launch | None:
    """An attention launch the interpreter ran in float32 or float16, as a bfloat16 model's
    (the GPU's dtype; the interpreter computes bfloat16 products wrongly) — with turbo-quant's
    4-bit codes decoded by `centroid_lookup`'s PTX, as on CUDA. None for other launches."""
    signature = dict(launch.signature)
    if signature.get("q_ptr") not in ("*fp32", "*fp16"):
        return None
    model = signature["q_ptr"]
    kinds = tuple(
        (k, "*bf16" if k in MODEL_DTYPE and v == model else v) for k, v in launch.signature
    )
    constants = dict(launch.constants)
    if constants.get("LOOKUP") == "" and constants.get("NIBBLES"):
        turbo = kernel_module("larql.kv.turbo_quant.kernels")
        book = codebook(constants["DP"], 4, torch.device("cpu"))
        constants["LOOKUP"] = turbo.centroid_lookup(book.centroids, torch.bfloat16)
    return Launch(
        launch.module,
        launch.name,
        kinds,
        tuple(constants.items()),
        launch.aligned,
        launch.options,
    )


def test_every_kernel_launch_compiles_for_sm90(
    smollm2: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    with recorded() as launches:
        _attention_launches()
        _product_launches()
        _elementwise_launches()
        _coded_launches()
        # the decode step on the real model: static caches alone and batched
        batching_tests.test_the_batch_kernel_gives_each_session_its_own_attention(
            smollm2, monkeypatch
        )
    kernels = {(launch.module, launch.name) for launch in launches}
    assert len(kernels) >= 12, sorted(kernels)  # every module above launched its kernels
    in_16_bits = [v for v in map(in_bfloat16, dict.fromkeys(launches)) if v is not None]
    assert any("LOOKUP" in dict(v.constants) and dict(v.constants)["LOOKUP"] for v in in_16_bits)
    failures = compile_failures(launches + in_16_bits)
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


def test_a_launch_that_cannot_compile_is_reported() -> None:
    """The check fails where the compiler does: a merge over 3 query rows (`tl.arange` takes
    powers of two only)."""
    kernels = kernel_module("larql.kernels.decode_attention")
    with recorded() as launches:
        kernels.decode_attention(
            torch.randn(4, 1, 64), torch.randn(1, 128, 64), torch.randn(1, 128, 64),
            torch.tensor([100]), 0.125,
        )  # fmt: skip
    launch = launches[0]
    narrow = Launch(
        launch.module,
        launch.name,
        launch.signature,
        tuple((k, 3 if k == "GR" else v) for k, v in launch.constants),
        launch.aligned,
        launch.options,
    )
    assert compile_failures([launch]) == {}
    failures = compile_failures([narrow])
    assert len(failures) == 1 and "power of 2" in next(iter(failures.values()))
