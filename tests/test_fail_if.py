"""--fail-if: every comparison operator and connective, each with a case where only one side holds."""
import math

import pytest

from harness.compare import CompareError, fail_if_violations

# two modes x two tensors; the numbers are chosen so that each expression below separates them
COMPARISON = {
    "reference": "fp32",
    "modes": {
        "0": {"output": {"sqnr_db": 15.0, "max_abs": 0.5, "cosine": 0.99, "identical": False, "input_differs": False},
              "residual": {"sqnr_db": 30.0, "max_abs": 0.1, "cosine": 0.999, "identical": False, "input_differs": True}},
        "2-4": {"output": {"sqnr_db": 20.0, "max_abs": 0.0, "cosine": 1.0, "identical": True, "input_differs": False},
                "residual": {"sqnr_db": math.inf, "max_abs": 0.0, "cosine": 1.0, "identical": True,
                             "input_differs": False}},
    },
}


def hits(expr):
    return sorted(fail_if_violations(expr, COMPARISON))


@pytest.mark.parametrize("expr, expected", [
    ("sqnr_db < 20", [("0", "output")]),                       # 20 itself does not hold
    ("sqnr_db <= 20", [("0", "output"), ("2-4", "output")]),
    ("sqnr_db > 20", [("0", "residual"), ("2-4", "residual")]),
    ("sqnr_db >= 20", [("0", "residual"), ("2-4", "output"), ("2-4", "residual")]),
    ("sqnr_db == 20", [("2-4", "output")]),
    ("sqnr_db != 20", [("0", "output"), ("0", "residual"), ("2-4", "residual")]),
    ("max_abs > -1", [("0", "output"), ("0", "residual"), ("2-4", "output"), ("2-4", "residual")]),
    ("-max_abs < -0.2", [("0", "output")]),                    # unary minus negates
])
def test_each_comparison_operator(expr, expected):
    assert hits(expr) == expected


@pytest.mark.parametrize("expr, expected", [
    # and: true only where both sides hold (each side alone holds somewhere else)
    ("mode == '0' and tensor == 'output'", [("0", "output")]),
    ("mode == '0' and sqnr_db > 100", []),
    ("sqnr_db > 100 and mode == '0'", []),
    # or: true where either side holds
    ("mode == '2-4' or tensor == 'output'", [("0", "output"), ("2-4", "output"), ("2-4", "residual")]),
    ("sqnr_db > 100 or max_abs > 0.4", [("0", "output"), ("2-4", "residual")]),
    ("max_abs > 0.4 or sqnr_db > 100", [("0", "output"), ("2-4", "residual")]),
    # not
    ("not identical", [("0", "output"), ("0", "residual")]),
    ("not (mode == '0' or tensor == 'residual')", [("2-4", "output")]),
    # boolean variables as they are
    ("input_differs", [("0", "residual")]),
    ("identical and tensor == 'output'", [("2-4", "output")]),
])
def test_each_connective(expr, expected):
    assert hits(expr) == expected


def test_chained_comparison_needs_every_link():
    """A chain a < b < c holds only when both links hold; the second link alone is not enough."""
    assert hits("10 < sqnr_db < 25") == [("0", "output"), ("2-4", "output")]
    assert hits("16 < sqnr_db < 25") == [("2-4", "output")]
    assert hits("10 < sqnr_db < 16") == [("0", "output")]
    assert hits("0 <= max_abs <= 0.1 < cosine") == [("0", "residual"), ("2-4", "output"), ("2-4", "residual")]


def test_inf_compares_as_a_number():
    assert hits("sqnr_db > 1e300") == [("2-4", "residual")]


def test_missing_metric_reads_as_false():
    """A row without a metric (e.g. input_differs absent) evaluates it as False, not as an error."""
    comp = {"modes": {"0": {"output": {"sqnr_db": 1.0}}}}
    assert fail_if_violations("input_differs", comp) == []
    assert fail_if_violations("not input_differs", comp) == [("0", "output")]
    assert fail_if_violations("input_differs == False", comp) == [("0", "output")]


@pytest.mark.parametrize("expr, needle", [
    ("sqnr_db < ", "not a valid expression"),
    ("sqnr < 3", "unknown name 'sqnr'"),
    ("__import__('os')", "Call is not allowed"),
    ("sqnr_db + 1 < 3", "BinOp is not allowed"),
    ("max_abs_index == 0", "unknown name 'max_abs_index'"),
    ("mode in ['0']", "is not allowed"),
])
def test_bad_expressions_are_refused_with_the_reason(expr, needle):
    with pytest.raises(CompareError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fail_if_violations(expr, COMPARISON)


def test_type_error_is_a_compare_error():
    with pytest.raises(CompareError, match="cannot be evaluated"):
        fail_if_violations("mode < 3", COMPARISON)
