"""Whether a checkpoint fits a model: same tables, same shapes, same dense tensors."""

from __future__ import annotations

from torchrec_cnr.commit.manifest import DenseInfo, Entry, TableShape
from torchrec_cnr.errors import ModelMismatchError

__all__ = ["check_compatible"]


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
    if problems:
        raise ModelMismatchError(
            f"checkpoint of step {entry.step} in {root} does not match the model:\n  "
            + "\n  ".join(problems)
        )
