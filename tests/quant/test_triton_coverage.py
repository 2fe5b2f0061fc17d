"""Every module of mixq that defines a Triton kernel has a test in the default suite (neither `slow` nor `gpu`) that
runs its kernels in Triton's interpreter against the torch / numpy path they replace.

The Gluon forward (quant/trellis/viterbi_gluon.py) has no interpreter: the default suite compiles it for sm_90 and
reads its step loop; its states are checked against the torch path by the `gpu` tests only.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

# kernel module -> the default-suite tests that interpret it ("file::function")
KERNEL_TESTS = {
    "quant/ggml/triton_kernels/descent.py": ["test_ggml_triton.py::test_descent_and_sum_kernels_equal_eager_in_interpreter"],
    "quant/ggml/triton_kernels/grid.py": ["test_ggml_triton.py::test_lattice_search_kernel_equals_eager_in_interpreter_small"],
    "quant/ggml/triton_kernels/iq2_decode.py": ["test_block_tuning.py::test_iq2_fused_search_and_decode_in_the_interpreter"],
    "quant/ggml/triton_kernels/iq2s.py": [
        "test_triton_rounding.py::test_fused_iq2s_search_finds_the_nearest_entries_interpreted",
        "test_block_tuning.py::test_iq2_fused_search_and_decode_in_the_interpreter"],
    "quant/ggml/triton_kernels/iq2s_descent.py": ["test_triton_rounding.py::test_fused_iq2s_descent_is_the_group_loop_interpreted"],
    "quant/ggml/triton_kernels/refine.py": ["test_triton_rounding.py::test_fused_code_descent_is_the_column_loop_interpreted"],
    "quant/ggml/triton_kernels/search.py": ["test_ggml_triton.py::test_kquant_search_kernels_equal_eager_in_interpreter_small"],
    "quant/ggml/triton_kernels/subscales.py": [
        "test_triton_rounding.py::test_fused_sub_scale_descent_is_the_sub_block_loop_interpreted"],
    "quant/trellis/viterbi.py": ["test_viterbi_fused.py::test_per_step_kernels_are_the_torch_step_in_interpreter"],
    "quant/trellis/viterbi_triton.py": ["test_viterbi_fused.py::test_exact_costs_give_the_torch_path_states_in_interpreter"],
    "quant/trellis/viterbi_gluon.py": ["test_viterbi_gluon.py::test_step_loop_on_sm90_has_one_exchange"],
}


def _kernel_modules() -> set[str]:
    """The package's modules with a @triton.jit / @gluon.jit function or a triton.jit(...) call."""
    found = set()
    for p in (REPO / "quant").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "jit" and isinstance(node.value, ast.Name) \
                    and node.value.id in ("triton", "gluon"):
                found.add(str(p.relative_to(REPO)))
    return found


def _marks(decorator: ast.expr) -> set[str]:
    """The pytest marks a decorator applies to the whole function (pytest.param marks inside apply to one case)."""
    if isinstance(decorator, ast.Call):
        if isinstance(decorator.func, ast.Attribute) and decorator.func.attr == "parametrize":
            return set()
        decorator = decorator.func
    if isinstance(decorator, ast.Attribute) and isinstance(decorator.value, ast.Attribute) \
            and decorator.value.attr == "mark":
        return {decorator.attr}
    return set()


def test_every_kernel_module_has_an_interpreter_test():
    assert _kernel_modules() == set(KERNEL_TESTS)


def test_the_kernel_tests_run_in_the_default_suite():
    for module, tests in KERNEL_TESTS.items():
        for test in tests:
            file, name = test.split("::")
            tree = ast.parse((REPO / "tests" / "quant" / file).read_text(encoding="utf-8"))
            fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
            assert fns, f"{module}: {test} does not exist"
            marks = set().union(*(_marks(d) for d in fns[0].decorator_list))
            assert not marks & {"slow", "gpu", "skip", "skipif"}, (test, marks)
