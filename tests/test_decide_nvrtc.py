"""Every kernel in cuda/ compiles with NVRTC for sm_80 and sm_90 without a GPU, warning-free."""

from __future__ import annotations

import re

import pytest

from kvledger.decide.ranking.cuda import KERNEL_NAMES, CompileError, compile_source, kernel_sources


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_source_compiles_to_a_cubin_without_warnings(arch: str) -> None:
    sources = kernel_sources()
    assert sources, "cuda/ holds no .cu sources"
    for name, source in sources.items():
        code, log = compile_source(source, arch)  # raises CompileError on any warning or error
        assert log == "", f"{name}: {log}"
        assert code.code_type == "cubin"
        assert len(bytes(code.code)) > 0


def test_the_backend_kernels_are_defined_in_rank_cu() -> None:
    source = kernel_sources()["rank.cu"]
    for kernel in KERNEL_NAMES:
        assert re.search(rf'extern "C" __global__ void (__launch_bounds__\(\w+\) )?{kernel}\(', source), kernel


def test_a_compiler_warning_fails_the_build() -> None:
    with pytest.raises(CompileError, match="warnings are errors"):
        compile_source('extern "C" __global__ void k(int* a) { int unused; a[0] = 1; }', "sm_90")
