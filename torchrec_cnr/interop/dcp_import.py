"""Importing a DCP checkpoint into a live model: how its keys map, checked before any write.

A DCP checkpoint of a TorchRec model, saved with ``dcp.save`` from any world size and
sharding, is read into this rank's shards block by block (DCP reshards on read):

- **rows**: the key of each table in the unsharded module's ``state_dict()``
  (``sparse.ebc.embedding_bags.t0.weight``), under a prefix found from the checkpoint:
  none for a flat ``dcp.save(dmp.state_dict())``, ``model.`` for TorchRec's recipe
  ``dcp.save({"model": dmp.state_dict(), "optim": ...})``, ``app.model.`` for a
  ``Stateful`` app state ``{"app": AppState}`` returning ``{"model": ..., "optim": ...}``;
- **dense state** (dense parameters, buffers, data-parallel tables): its own keys, under
  the same prefix;
- **fused optimizer state**: ``<prefix>state.<table key>.<table>.<state>``, the keys of
  ``dmp.fused_optimizer.state_dict()`` (``t0.momentum1``) under a prefix found likewise
  (``optim.``). A per-row state saved column-wise (``k`` column shards, ``(k * rows,)``)
  maps as a restore maps it: a shard takes the state of the saved column shard holding
  its first column. Without it, the state is zeroed (as a fresh kernel's) with a warning;
- **app_state**: each object's ``state_dict()`` under its own name (or the key
  ``app_keys`` gives it), loaded with ``load_state_dict``; objects pickled in it are
  unpickled allowing only ``safe_globals``. One missing is left as it is, with a warning.

The kernels' step counters (``iter``) are not in ``fused_optimizer.state_dict()``; they
stay as they are, as after ``dcp.load``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_cnr.collectives import Collective
from torchrec_cnr.errors import ModelMismatchError
from torchrec_cnr.interop.dcp_io import DcpReader, fused_state_path
from torchrec_cnr.restore.collective import load_app_state
from torchrec_cnr.tracking.shard import LocalShard, ShardSpec

__all__ = ["DcpPlan", "import_dcp"]


def _prefix(reader: DcpReader, suffixes: Iterable[str]) -> str | None:
    """The prefix under which the checkpoint holds most of ``suffixes`` (``""`` if they
    are top-level keys); ``None`` if it holds none."""
    wanted = set(suffixes)
    found: Counter[str] = Counter()
    for key in reader.keys:
        for cut in [0] + [i + 1 for i, ch in enumerate(key) if ch == "."]:
            if key[cut:] in wanted:
                found[key[:cut]] += 1
    return found.most_common(1)[0][0] if found else None


def _state_key(shard: LocalShard, state: str) -> str:
    return ".".join(fused_state_path(shard.spec.state_dict_key, shard.spec.table, state))


@dataclass
class DcpPlan:
    """Which block of which key lands in each of this rank's tensors."""

    blocks: list[tuple[str, tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    zeroed: list[str] = field(default_factory=list)
    """Optimizer states the checkpoint lacks."""
    app: dict[str, str] = field(default_factory=dict)
    """``app_state`` name -> its key in the checkpoint."""

    def add(self, key: str, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        self.blocks.append((key, offsets, out))

    @classmethod
    def of(
        cls,
        reader: DcpReader,
        shards: list[LocalShard],
        dense: Mapping[str, torch.Tensor],
        app_state: Mapping[str, Any],
        app_keys: Mapping[str, str],
    ) -> DcpPlan:
        """Maps the checkpoint onto this rank's tensors.

        Raises:
            ModelMismatchError: a table or dense tensor missing or of another shape, or
                an optimizer state of another shape; the message names each.
        """
        plan, problems = cls(), []
        tables = {s.spec.state_dict_key: s for s in shards}
        model = _prefix(reader, [*tables, *dense])
        if model is None:
            raise ModelMismatchError(
                f"{reader.path} holds none of the model's tables or dense tensors "
                f"(e.g. {sorted(tables)[:3]}); its keys: {sorted(reader.keys)[:8]}"
            )
        optim = _prefix(reader, [_state_key(s, n) for s in shards for n in s.states])
        for s in shards:
            spec = s.spec
            key, want = model + spec.state_dict_key, (spec.num_embeddings, spec.embedding_dim)
            if reader.size(key) != want:
                problems.append(_mismatch(key, reader.size(key), want))
                continue
            plan.add(key, (spec.row_offset, spec.col_offset), s.weight)
            splits = sorted({o[1] for o, _ in reader.chunks(key)})
            for name, state in s.states.items():
                skey = "" if optim is None else optim + _state_key(s, name)
                size = reader.size(skey)
                at = None if size is None else _state_offsets(spec, state, size, splits)
                if size is None:
                    plan.zeroed.append(f"{spec.table}.{name}")
                elif at is None:
                    problems.append(_mismatch(skey, size, tuple(state.shape), "per shard"))
                else:
                    plan.add(skey, at, state)
        for name, tensor in dense.items():
            if reader.size(model + name) != tuple(tensor.shape):
                problems.append(_mismatch(model + name, reader.size(model + name), tensor.shape))
            else:
                plan.add(model + name, (0,) * tensor.dim(), tensor)
        if problems:
            raise ModelMismatchError(
                f"{reader.path} is not a checkpoint of this model: " + "; ".join(sorted(problems))
            )
        for name in app_state:
            key = app_keys.get(name, name)
            if any(k.startswith(key + ".") for k in reader.keys):
                plan.app[name] = key
        return plan


def _is_optimizer_state(d: Mapping[Any, Any]) -> bool:
    """Whether ``d`` has the shape of a torch optimizer's state dict."""
    groups = d.get("param_groups")
    return (
        isinstance(d.get("state"), dict)
        and isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
    )


def _optimizer_ids(saved: Any) -> Any:
    """``saved`` with every torch optimizer state dict in it (an ``app_state`` object's
    whole state dict, or one entry of a holder of several) keyed as it was saved: DCP
    keeps every dict key as a string, so the parameter ids of a ``state`` come back as
    ``"0"``, ``"1"``, ...; those its ``param_groups`` list as ints become ints again."""
    if isinstance(saved, dict):
        if _is_optimizer_state(saved):
            ids = {str(p): p for g in saved["param_groups"] for p in g["params"]}
            saved["state"] = {ids.get(k, k): v for k, v in saved["state"].items()}
        for value in saved.values():
            _optimizer_ids(value)
    elif isinstance(saved, list):
        for value in saved:
            _optimizer_ids(value)
    return saved


def _state_offsets(
    spec: ShardSpec, state: torch.Tensor, size: tuple[int, ...], splits: list[int]
) -> tuple[int, ...] | None:
    """Where a shard's optimizer state starts in the saved one (``splits``: the saved
    column shards' first columns); ``None`` if the saved shape does not fit."""
    n = spec.num_embeddings
    if state.dim() == 2:
        return (spec.row_offset, spec.col_offset) if size == (n, spec.embedding_dim) else None
    if size == (n,):
        return (spec.row_offset,)
    if size == (len(splits) * n,):  # column shard j of k keeps its row-wise state at j * n
        j = sum(c <= spec.col_offset for c in splits) - 1
        return (j * n + spec.row_offset,)
    return None


def _mismatch(
    key: str, saved: tuple[int, ...] | None, want: Any, where: str = "in the model"
) -> str:
    found = "absent" if saved is None else str(saved)
    return f"{key}: {found} in the checkpoint, {tuple(want)} {where}"


def import_dcp(
    group: Collective,
    path: str,
    shards: list[LocalShard],
    dense: Mapping[str, torch.Tensor],
    app_state: Mapping[str, Any],
    app_keys: Mapping[str, str] | None = None,
    safe_globals: Iterable[Any] = (),
) -> DcpPlan:
    """Reads the DCP checkpoint at ``path`` into this rank's shards, dense tensors and
    ``app_state`` (collective: every rank checks, then reads its own blocks).

    Raises:
        CheckpointReadError: no readable DCP checkpoint at ``path``.
        ModelMismatchError: a checkpoint of another model (on every rank; nothing changed).
        UnsafeObjectError: an ``app_state`` object names a type not in ``safe_globals``.
    """
    keys = dict(app_keys or {})
    reader = group.agree_on(lambda: DcpReader(path))
    plan = group.agree_on(lambda: DcpPlan.of(reader, shards, dense, app_state, keys))
    saved = group.agree_on(
        lambda: {
            name: _optimizer_ids(reader.objects(key, safe_globals))
            for name, key in plan.app.items()
        }
    )

    @torch.no_grad()
    def read() -> None:
        for shard in shards:
            shard.drain()
        reader.read(plan.blocks)
        for shard in shards:
            for name, state in shard.states.items():
                if f"{shard.spec.table}.{name}" in plan.zeroed:
                    state.zero_()

    # Read in place: a read that fails midway (a damaged file) leaves a partial import,
    # on every rank alike; the root is untouched.
    group.agree_on(read)
    if plan.zeroed:
        warnings.warn(
            f"{path} holds no optimizer state for {sorted(plan.zeroed)[:6]}"
            f"{' ...' if len(plan.zeroed) > 6 else ''}: zeroed, as a fresh kernel's",
            stacklevel=3,
        )
    load_app_state(group, app_state, saved, dense)  # warns of each one it lacks
    return plan
