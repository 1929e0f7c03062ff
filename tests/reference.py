"""Copies of a model's full state taken at save time, and bit-exact comparison against them.

A reference is taken on every rank and written to a file, so a restore onto
another sharding or world size can compare against the union of all ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrec_cnr.manifest import Manifest
from torchrec_cnr.tracking import model_state


def take(model: torch.nn.Module, app_state: dict[str, Any]) -> dict[str, Any]:
    shards = [
        (s.spec, s.weight.detach().clone(), {k: v.detach().clone() for k, v in s.states.items()})
        for s in model_state.local_shards(model)
    ]
    dense = {k: v.detach().clone() for k, v in model_state.dense_state(model).items()}
    app = {k: copy.deepcopy(v.state_dict()) for k, v in app_state.items()}
    return {"shards": shards, "dense": dense, "app": app}


def save(ref: dict[str, Any], folder: Path, step: int) -> None:
    torch.save(ref, folder / f"ref-{step}-{dist.get_rank()}.pt")


def load_all(folder: Path, step: int) -> list[dict[str, Any]]:
    files = sorted(folder.glob(f"ref-{step}-*.pt"), key=lambda p: int(p.stem.split("-")[-1]))
    assert files, f"no reference for step {step}"
    return [torch.load(f, weights_only=False) for f in files]


def _equal_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_equal_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    return a == b


def assert_model_matches(
    model: torch.nn.Module,
    app_state: dict[str, Any],
    refs: list[dict[str, Any]],
    check_states: bool = True,
    expected_rows: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Asserts every element of every local shard, the dense state and this rank's
    app_state equal the references bit for bit.

    Per-element optimizer states are compared by column like the weights; a per-row
    state against the saved shard holding the local shard's first column, the one
    restore takes it from.
    ``expected_rows(table, weight)`` maps a reference shard's rows to what a
    restore must produce (e.g. their quantize-dequantize round trip).
    """
    saved = [shard for ref in refs for shard in ref["shards"]]
    for local in model_state.local_shards(model):
        ls = local.spec
        covered = torch.zeros(ls.rows, ls.cols, dtype=torch.bool)
        for spec, weight, states in saved:
            if spec.table != ls.table:
                continue
            if expected_rows is not None:
                weight = expected_rows(spec.table, weight)
            r0, r1 = (
                max(ls.row_offset, spec.row_offset),
                min(ls.row_offset + ls.rows, spec.row_offset + spec.rows),
            )
            c0, c1 = (
                max(ls.col_offset, spec.col_offset),
                min(ls.col_offset + ls.cols, spec.col_offset + spec.cols),
            )
            if r0 >= r1 or c0 >= c1:
                continue
            got = local.weight[
                r0 - ls.row_offset : r1 - ls.row_offset, c0 - ls.col_offset : c1 - ls.col_offset
            ]
            want = weight[
                r0 - spec.row_offset : r1 - spec.row_offset,
                c0 - spec.col_offset : c1 - spec.col_offset,
            ]
            assert torch.equal(got, want), f"{ls.table} rows {r0}:{r1} cols {c0}:{c1} differ"
            covered[
                r0 - ls.row_offset : r1 - ls.row_offset, c0 - ls.col_offset : c1 - ls.col_offset
            ] = True
            if not check_states:
                continue
            assert local.states.keys() == states.keys(), (
                ls.table,
                local.states.keys(),
                states.keys(),
            )
            holds_first_col = spec.col_offset <= ls.col_offset < spec.col_offset + spec.cols
            for name, value in local.states.items():
                # Per-element states map by column like the weights; a per-row state comes
                # from the saved shard holding the local shard's first column.
                got_state = value[r0 - ls.row_offset : r1 - ls.row_offset]
                want_state = states[name][r0 - spec.row_offset : r1 - spec.row_offset]
                if value.dim() == 2:
                    got_state = got_state[:, c0 - ls.col_offset : c1 - ls.col_offset]
                    want_state = want_state[:, c0 - spec.col_offset : c1 - spec.col_offset]
                elif not holds_first_col:
                    continue
                assert torch.equal(got_state, want_state), f"{ls.table} {name} differs"
        assert bool(covered.all()), f"{ls.table}: some elements have no reference"
    dense = model_state.dense_state(model)
    assert dense.keys() == refs[0]["dense"].keys()
    for key, value in dense.items():
        assert torch.equal(value, refs[0]["dense"][key]), f"dense {key} differs"
    # A rank beyond the saved world size takes the app_state of rank % world size.
    saved_app = refs[dist.get_rank() % len(refs)]["app"]
    for name, obj in app_state.items():
        assert _equal_state(obj.state_dict(), saved_app[name]), f"app_state {name} differs"


def full_tables(refs: list[dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """Each table's whole weight and optimizer states, assembled from every rank's reference.

    Per-element states are assembled by column; a per-row state comes from the shards
    that hold the table's first column, as a restore and ``read_optimizer_state`` take it.
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for ref in refs:
        for spec, weight, states in ref["shards"]:
            table = out.setdefault(
                spec.table, {"weight": torch.zeros(spec.num_embeddings, spec.embedding_dim)}
            )
            rows = slice(spec.row_offset, spec.row_offset + spec.rows)
            cols = slice(spec.col_offset, spec.col_offset + spec.cols)
            table["weight"][rows, cols] = weight
            for name, value in states.items():
                if value.dim() == 2:
                    full = table.setdefault(
                        name, torch.zeros(spec.num_embeddings, spec.embedding_dim)
                    )
                    full[rows, cols] = value.float()
                elif spec.col_offset == 0:
                    table.setdefault(name, torch.zeros(spec.num_embeddings))[rows] = value.float()
    return out


def tables_at(folder: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The whole tables of every rank's reference of ``step`` (see :func:`full_tables`)."""
    return full_tables(load_all(folder, step))


def latest_tables(root: str) -> list[str]:
    """The tables the latest committed checkpoint of ``root`` records."""
    manifest = Manifest.load(root)
    latest = manifest.latest()
    assert latest is not None, f"{root} holds no checkpoint"
    return list(manifest.record(latest).tables)
