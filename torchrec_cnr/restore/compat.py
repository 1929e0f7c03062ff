"""Whether a checkpoint fits a model: same tables, same shapes, same dense tensors.

Two views of a model, one rule each: a training model's tables by qualified name
(:func:`check_compatible`, for restores) and a serving model's by unsharded state-dict
key (:func:`check_serving`, for a follower). Both name every difference at once and
raise before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchrec_cnr.errors import ModelMismatchError
from torchrec_cnr.manifest import DenseInfo, Entry, TableShape

__all__ = ["check_compatible", "check_serving"]


def _mismatch(entry: Entry, root: str, model: str, problems: list[str]) -> None:
    if problems:
        raise ModelMismatchError(
            f"checkpoint of step {entry.step} in {root} does not match the {model}:\n  "
            + "\n  ".join(problems)
        )


def check_compatible(
    entry: Entry, tables: dict[str, TableShape], dense: dict[str, DenseInfo], root: str
) -> None:
    """Raises :class:`ModelMismatchError` naming every difference between model and checkpoint.

    Args:
        entry: the checkpoint.
        tables: the model's tables (qualified names) and shapes, over every rank.
        dense: the model's dense tensors.
        root: the checkpoint root, for the message.
    """
    problems = []
    for name in sorted(set(entry.tables) | set(tables)):
        if name not in tables:
            problems.append(f"table {name!r} is in the checkpoint but not in the model")
        elif name not in entry.tables:
            problems.append(f"table {name!r} is in the model but not in the checkpoint")
        elif entry.tables[name] != tables[name]:
            s, m = entry.tables[name], tables[name]
            problems.append(
                f"table {name!r} is {s.num_embeddings}x{s.embedding_dim} in the checkpoint "
                f"but {m.num_embeddings}x{m.embedding_dim} in the model"
            )
    for name in sorted(set(entry.dense) | set(dense)):
        if name not in dense:
            problems.append(f"dense tensor {name!r} is in the checkpoint but not in the model")
        elif name not in entry.dense:
            problems.append(f"dense tensor {name!r} is in the model but not in the checkpoint")
        elif entry.dense[name] != dense[name]:
            problems.append(
                f"dense tensor {name!r} is {entry.dense[name]} in the checkpoint but "
                f"{dense[name]} in the model"
            )
    _mismatch(entry, root, "model", problems)


def check_serving(
    entry: Entry,
    tables: Mapping[str, tuple[int, int]],
    dense: Mapping[str, Sequence[int]],
    root: str,
) -> None:
    """Raises :class:`ModelMismatchError` naming every difference between a serving model
    and a checkpoint.

    Args:
        entry: the checkpoint.
        tables: the serving model's tables by unsharded state-dict key: ``(rows, dim)``.
            A data-parallel table may come from the checkpoint's dense state instead.
        dense: the serving model's dense tensors and their shapes.
        root: the checkpoint root, for the message.
    """
    problems = []
    for name, shape in entry.tables.items():
        key = shape.state_dict_key
        slot = tables.get(key)
        if not key:
            problems.append(
                f"table {name!r}: the checkpoint records no state-dict key (format < 3)"
            )
        elif slot is None:
            problems.append(f"table {name!r} ({key}) is in the checkpoint but not in the model")
        elif tuple(slot) != (shape.num_embeddings, shape.embedding_dim):
            problems.append(
                f"table {key} is {shape.num_embeddings}x{shape.embedding_dim} in the "
                f"checkpoint but {slot[0]}x{slot[1]} in the model"
            )
    # Data-parallel tables are replicated and travel with the dense state.
    known = {s.state_dict_key for s in entry.tables.values()} | set(entry.dense)
    problems += [
        f"table {key} is in the model but not in the checkpoint"
        for key in sorted(set(tables) - known)
    ]
    problems += [
        f"dense tensor {name!r} is in the model but not in the checkpoint"
        for name in sorted(set(dense) - set(entry.dense))
    ]
    for name in sorted(set(dense) & set(entry.dense)):
        want, got = list(entry.dense[name].shape), list(dense[name])
        if want != got:
            problems.append(
                f"dense tensor {name!r} is {want} in the checkpoint but {got} in the model"
            )
    _mismatch(entry, root, "serving model", problems)
