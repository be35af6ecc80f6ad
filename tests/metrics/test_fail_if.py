"""--fail-if: every comparison operator and connective, each with a case where only one side holds."""
import math

import pytest

from harness.metrics.compare import CompareError, fail_if_violations

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


# one mode, two tensors: "output" has an undefined (NaN) SQNR, "residual" a defined one
NAN_COMPARISON = {"reference": "fp32", "modes": {"q": {
    "output": {"sqnr_db": math.nan, "max_abs": 0.5, "identical": False, "input_differs": False},
    "residual": {"sqnr_db": 30.0, "max_abs": 0.1, "identical": False, "input_differs": False}}}}


@pytest.mark.parametrize("expr, expected", [
    # not of unknown is unknown (a fail), so a double not gives back unknown, not False (mutant compare _eval 10)
    ("not not (sqnr_db < 20)", ["output"]),
    # minus of unknown is unknown, not a TypeError (mutant compare _eval 14)
    ("-(sqnr_db < 20) < 0", ["output"]),
    # and: unknown with true is unknown, so its negation is unknown too (mutants compare _eval 30, 32)
    ("not (sqnr_db < 20 and mode == 'q')", ["output", "residual"]),
    # and: all true is true, so its negation is false (mutants compare _eval 31, 32)
    ("not (mode == 'q' and tensor == 'output')", ["residual"]),
    # or: unknown with false is unknown, not false (mutant compare _eval 40)
    ("sqnr_db < 20 or tensor == 'x'", ["output"]),
    # an unknown left operand (a nested comparison) makes the comparison unknown (mutant compare _eval 75)
    ("(sqnr_db < 20) == False", ["output", "residual"]),
    # a NaN right operand makes the comparison unknown, as on the left (mutant compare _eval 79)
    ("20 > sqnr_db", ["output"]),
])
def test_unknown_follows_three_valued_logic(expr, expected):
    """A NaN metric makes a comparison "unknown"; not, unary minus, and, or and a comparison of an unknown
    keep it unknown (Kleene logic), and an unknown result is a failure: each case tells true, false and
    unknown apart where a wrong rule would turn the NaN row into a pass (or a crash)."""
    assert sorted(t for _, t in fail_if_violations(expr, NAN_COMPARISON)) == expected


def test_nesting_limit_is_32_levels_exactly():
    """32 levels of nesting are accepted and 33 refused with the level count, counted from 1 at the
    expression and 1 more per level (mutants compare _depth 2, 13 and _parse_fail_if 16); the deepest
    branch counts wherever it sits, also as the first operand of an or (mutant compare _depth 10)."""
    assert hits("not " * 29 + "identical") == [("0", "output"), ("0", "residual")]          # 32 levels
    with pytest.raises(CompareError, match=r"nested too deeply \(33 levels\); at most 32 levels"):
        hits("not " * 30 + "identical")
    assert hits("(" + "not " * 28 + "identical) or identical") == [("2-4", "output"), ("2-4", "residual")]
    with pytest.raises(CompareError, match=r"nested too deeply \(33 levels\); at most 32 levels"):
        hits("(" + "not " * 29 + "identical) or identical")


def test_length_limit_is_2000_characters_exactly():
    """An expression of exactly 2000 characters is accepted, one of 2001 refused with its length
    (mutant compare _parse_fail_if 5)."""
    expr = "sqnr_db < 20"
    assert hits(expr + " " * (2000 - len(expr))) == [("0", "output")]
    with pytest.raises(CompareError, match="expression is 2001 characters long; at most 2000 are accepted"):
        hits(expr + " " * (2001 - len(expr)))


def test_parser_recursion_error_is_a_compare_error():
    """When the parser runs out of recursion depth (a deeply nested expression under a low recursion
    limit), the error is a CompareError that names --fail-if and the nesting limit (mutant compare
    _parse_fail_if 14, which raised CompareError(None))."""
    import sys

    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 100)    # the AST builder allows 3 levels per frame: ~300 < the 1999 below
    try:
        with pytest.raises(CompareError, match=r"^--fail-if expression is nested too deeply; at most 32 levels$"):
            fail_if_violations("-" * 1999 + "1", COMPARISON)
    finally:
        sys.setrecursionlimit(old)
