"""Compare every mode against a reference mode, tensor by tensor; find bit-identical modes; --fail-if.

Input is a mapping mode -> tensor -> array (from a run in memory or a capture
file); output is the JSON-ready dict written by ``compare_with_fp.py --json``:

    {"reference": REF,
     "modes": {MODE: {TENSOR: {mse, mae, rmse, max_abs, max_abs_index, rel_l2, sqnr_db,
                                cosine, pearson, p50, p90, p99, input_differs, identical}}},
     "identical_groups": [[MODE, ...], ...],      modes bit-identical in every tensor they share
     "skipped": {MODE: {TENSOR: reason}}}
"""
from __future__ import annotations

import ast
import copy
import hashlib
import math
import re
from typing import Callable, Mapping

import numpy as np

from .errors import METRIC_NAMES, error_metrics

__all__ = ["CompareError", "compare_modes", "same_basis", "identical_groups", "fail_if_violations", "input_tensor_for",
           "compared_pairs", "failed_modes"]

ArrayGetter = Callable[[str, str], np.ndarray]


class CompareError(ValueError):
    """The comparison cannot be made as asked (unknown reference, bad --fail-if expression)."""


def input_tensor_for(tensor: str) -> str:
    """The block input that feeds `tensor`: "input" for layer 0's tensors, L{i}.block.in otherwise."""
    m = re.match(r"^L(\d+)\.", tensor)
    return "input" if m is None or m.group(1) == "0" else f"L{m.group(1)}.block.in"


def compare_modes(tensors: Mapping[str, list[str]], get: ArrayGetter, reference: str,
                  comparable: Callable[[str, str], str | None] | None = None, groups: bool = True,
                  known: dict | None = None, digest: Callable[[str, str], bytes] | None = None) -> dict:
    """Metrics of every mode against `reference` for every tensor both have.

    tensors: mode -> tensor names; get(mode, tensor) -> array; comparable(mode, tensor)
    returns a reason to skip the pair (e.g. different bases) or None. groups=False leaves out
    "identical_groups" (a caller that compares part of the tensors finds them from digests).
    known and digest(mode, tensor) (storage.array_digest of its array): a caller comparing mode after
    mode with one reference keeps `known` between calls; a tensor whose array another mode had
    already, bit for bit, takes that mode's metrics instead of computing them again.
    """
    if reference not in tensors:
        raise CompareError(f"reference mode {reference!r} is not in the file; modes present: {', '.join(tensors) or 'none'}"
                           + (f"; choose one with --reference {next(iter(tensors))}" if tensors else ""))
    out: dict = {"reference": reference, "modes": {}, "skipped": {}}
    ref_names = set(tensors[reference])
    equal = _memo_equal(get)
    for mode, names in tensors.items():
        if mode == reference:
            continue
        rows = {}
        for tensor in names:
            reason = None if tensor in ref_names else "not captured in the reference"
            reason = reason or (comparable(mode, tensor) if comparable else None)
            if reason is None:
                ref, test = get(reference, tensor), get(mode, tensor)
                if ref.shape != test.shape:
                    reason = f"shape {list(test.shape)} differs from the reference's {list(ref.shape)}"
            if reason is not None:
                out["skipped"].setdefault(mode, {})[tensor] = reason
                continue
            key = None if known is None or digest is None else (tensor, digest(mode, tensor))
            if key is not None and key in known:
                row = copy.deepcopy(known[key])
            else:
                row = error_metrics(ref, test)
                row["identical"] = equal(reference, mode, tensor)
                if key is not None:
                    known[key] = copy.deepcopy(row)
            src = input_tensor_for(tensor)
            if src in ref_names and src in names:
                row["input_differs"] = not equal(reference, mode, src)
            rows[tensor] = row
        out["modes"][mode] = rows
    if groups:
        out["identical_groups"] = identical_groups(tensors, get, equal)
    return out


def _memo_equal(get: ArrayGetter) -> Callable[[str, str, str], bool]:
    """equal(mode_a, mode_b, tensor): ``_equal`` of the two modes' arrays, each pair compared once
    (a block's input is asked for by every tensor it feeds, and again by identical_groups)."""
    seen: dict[tuple[str, str, str], bool] = {}

    def equal(a: str, b: str, tensor: str) -> bool:
        key = (a, b, tensor) if a <= b else (b, a, tensor)
        if key not in seen:
            seen[key] = _equal(get(a, tensor), get(b, tensor))
        return seen[key]
    return equal


_EQUAL_CHUNK = 1 << 18


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal values (NaN at the same places counts as equal); compared in chunks of the
    flattened arrays, stopping at the first that differs (a quantized mode's logits differ at once;
    compared whole, their masks and copies were five 25-100 MB arrays)."""
    if a.shape != b.shape:
        return False
    nan_ok = a.dtype.kind in "fc" and b.dtype.kind in "fc"
    fa, fb = np.ravel(a), np.ravel(b)
    return all(np.array_equal(fa[i:i + _EQUAL_CHUNK], fb[i:i + _EQUAL_CHUNK], equal_nan=nan_ok)
               for i in range(0, max(fa.size, 1), _EQUAL_CHUNK))


def failed_modes(stats: dict, tensors: Mapping[str, list[str]], reference: str,
                 wanted: Callable[[str], bool]) -> dict[str, dict]:
    """MODE -> {"error", "missing"} for every wanted mode the capture's stats record as failed (an entry whose
    status is not "ok", or a name in "failed_modes"): its error, and the tensors the reference has that the
    failed mode left no array for (a mode that fails at layer i keeps only the blocks before i).
    A mode in error is never a pass: compare --fail-if fails on it whatever the expression."""
    entries = stats.get("modes") if isinstance(stats.get("modes"), dict) else {}
    listed = stats.get("failed_modes") if isinstance(stats.get("failed_modes"), list) else []
    out: dict[str, dict] = {}
    for mode in dict.fromkeys([*entries, *(str(m) for m in listed)]):
        entry = entries.get(mode) if isinstance(entries.get(mode), dict) else {}
        if not wanted(mode) or (entry.get("status", "ok") == "ok" and mode not in listed):
            continue
        have = set(tensors.get(mode, []))
        out[mode] = {"error": str(entry.get("error") or "failed"),
                     "missing": [t for t in tensors.get(reference, []) if t not in have]}
    return out


def compared_pairs(comparison: dict) -> int:
    return sum(len(rows) for rows in comparison["modes"].values())


def same_basis(basis_of: Callable[[str, str], str | None], reference: str) -> Callable[[str, str], str | None]:
    """A `comparable` rule for compare_modes: skip pairs whose recorded bases differ."""
    def check(mode: str, tensor: str) -> str | None:
        mine, ref = basis_of(mode, tensor), basis_of(reference, tensor)
        return None if mine == ref else f"basis differs ({mine} vs {ref})"
    return check


def _value_key(arr) -> bytes:
    """A digest equal for every two arrays `_equal` calls equal (same shape and values; NaN at the same places;
    -0.0 and 0.0 alike; any dtype of the same values): numbers are hashed as float64 with one NaN and one zero,
    in chunks (no float64 copy of a large array). Equal keys are only candidates: `_equal` confirms them."""
    a = np.asarray(arr)
    h = hashlib.sha256(repr(a.shape).encode())
    flat = np.ravel(a)
    if a.dtype.kind not in "fiub":
        h.update(a.dtype.str.encode())
        h.update(np.ascontiguousarray(flat).view(np.uint8))
        return h.digest()
    for i in range(0, flat.size, _EQUAL_CHUNK):
        chunk = flat[i:i + _EQUAL_CHUNK].astype(np.float64) + 0.0   # -0.0 + 0.0 is 0.0
        chunk[np.isnan(chunk)] = np.nan                              # one NaN bit pattern
        h.update(chunk.view(np.uint8))
    return h.digest()


def identical_groups(tensors: Mapping[str, list[str]], get: ArrayGetter,
                     equal: Callable[[str, str, str], bool] | None = None,
                     key: Callable[[str, str], bytes] | None = None) -> list[list[str]]:
    """Groups (of 2 or more) of modes whose every shared tensor is bit-identical (`equal`: a memo of compare_modes).

    A mode joins the first group (in the modes' order) whose first mode shares at least one tensor with it
    and equals it in every shared one. Near linear in modes x tensors: each array is hashed once
    (`key(mode, tensor)`, default ``_value_key``), and a mode is checked (with `equal`) only against groups
    whose first mode has the same hashes on the shared tensors, found through an index per pair of
    (group's tensor set, shared set); a file's modes have a handful of distinct tensor sets.
    """
    equal = equal or (lambda a, b, t: _equal(get(a, t), get(b, t)))
    key = key or (lambda m, t: _value_key(get(m, t)))
    keys = {m: {t: key(m, t) for t in dict.fromkeys(names)} for m, names in tensors.items()}
    groups: list[list[str]] = []
    heads_by_set: dict[frozenset, list[int]] = {}            # tensor set of a group's first mode -> group ids
    index: dict[tuple[frozenset, frozenset], dict[tuple, list[int]]] = {}

    def candidates(head_set: frozenset, shared: frozenset) -> dict[tuple, list[int]]:
        if (head_set, shared) not in index:
            table: dict[tuple, list[int]] = {}
            order = sorted(shared)
            for g in heads_by_set[head_set]:
                table.setdefault(tuple(keys[groups[g][0]][t] for t in order), []).append(g)
            index[(head_set, shared)] = table
        return index[(head_set, shared)]

    for mode in tensors:
        mine = frozenset(keys[mode])
        found = []
        for head_set in heads_by_set:
            shared = mine & head_set
            if shared:
                sig = tuple(keys[mode][t] for t in sorted(shared))
                found += candidates(head_set, shared).get(sig, [])
        for g in sorted(found):
            head = groups[g][0]
            if all(equal(head, mode, t) for t in keys[mode] if t in keys[head]):
                groups[g].append(mode)
                break
        else:
            groups.append([mode])
            g = len(groups) - 1
            heads_by_set.setdefault(mine, []).append(g)
            for (head_set, shared), table in index.items():
                if head_set == mine:
                    table.setdefault(tuple(keys[mode][t] for t in sorted(shared)), []).append(g)
    return [g for g in groups if len(g) > 1]


_ALLOWED_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.Compare,
                  ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq, ast.Name, ast.Load, ast.Constant)
_VARIABLES = tuple(n for n in METRIC_NAMES if n != "max_abs_index") + ("input_differs", "identical", "mode", "tensor")
MAX_EXPR_CHARS = 2000
MAX_EXPR_DEPTH = 32


def _depth(node: ast.AST) -> int:
    stack, deepest = [(node, 1)], 0
    while stack:
        n, d = stack.pop()
        deepest = max(deepest, d)
        stack += [(c, d + 1) for c in ast.iter_child_nodes(n)]
    return deepest


def _parse_fail_if(expr: str) -> ast.Expression:
    if not isinstance(expr, str) or not expr.strip():
        raise CompareError("--fail-if needs an expression, e.g. \"tensor == 'output' and sqnr_db < 20\"")
    if len(expr) > MAX_EXPR_CHARS:
        raise CompareError(f"--fail-if expression is {len(expr)} characters long; at most {MAX_EXPR_CHARS} are accepted")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CompareError(f"--fail-if {expr!r} is not a valid expression ({e.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise CompareError(f"--fail-if expression is nested too deeply; at most {MAX_EXPR_DEPTH} levels") from None
    if _depth(tree) > MAX_EXPR_DEPTH:
        raise CompareError(f"--fail-if expression is nested too deeply ({_depth(tree)} levels); "
                           f"at most {MAX_EXPR_DEPTH} levels")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise CompareError(f"--fail-if {expr!r}: {type(node).__name__} is not allowed; use comparisons of "
                               f"{', '.join(_VARIABLES)} with numbers or strings, joined by and/or/not")
        if isinstance(node, ast.Name) and node.id not in _VARIABLES:
            raise CompareError(f"--fail-if {expr!r}: unknown name {node.id!r}; valid: {', '.join(_VARIABLES)}")
    return tree


def _is_nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _eval(node: ast.AST, env: dict):
    """Three-valued (Kleene) evaluation: a comparison with a NaN operand is None ("unknown")."""
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, env)
        if isinstance(node.op, ast.Not):
            return None if value is None else (not value)
        return None if value is None else -value
    if isinstance(node, ast.BoolOp):
        values = [_eval(v, env) for v in node.values]
        if isinstance(node.op, ast.And):
            return False if any(v is not None and not v for v in values) else (None if None in values else True)
        return True if any(v is not None and v for v in values) else (None if None in values else False)
    left = _eval(node.left, env)
    ops = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
           ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
    result = True
    for op, comparator in zip(node.ops, node.comparators):
        right = _eval(comparator, env)
        if left is None or right is None or _is_nan(left) or _is_nan(right):
            result = None if result is not False else False
        elif not ops[type(op)](left, right):
            return False
        left = right
    return result


def fail_if_violations(expr: str, comparison: dict) -> list[tuple[str, str]]:
    """(mode, tensor) pairs for which `expr` is true or unknown (it compares a NaN metric).

    A NaN metric is never a pass: a comparison with a NaN operand is "unknown" and
    and/or/not follow three-valued logic; a pair whose result is unknown fails.
    """
    tree = _parse_fail_if(expr)
    hits = []
    for mode, rows in comparison["modes"].items():
        for tensor, row in rows.items():
            env = {name: row.get(name, False) for name in _VARIABLES}
            env.update(mode=mode, tensor=tensor)
            try:
                result = _eval(tree, env)
            except TypeError as e:
                raise CompareError(f"--fail-if {expr!r} cannot be evaluated ({e})") from None
            if result is None or result:
                hits.append((mode, tensor))
    return hits
