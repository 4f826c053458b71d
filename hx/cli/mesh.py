"""The form of ``--mesh``: ``tp=A,pp=B`` (read by ``hx.cli.main`` before the command's own
parsing, to start as many emulated accelerators, and by ``hx generate``)."""

from __future__ import annotations


def mesh_shape(text: str) -> tuple[int, int]:
    """(tp, pp) of a mesh written ``tp=A,pp=B`` (either may be left out: 1).

    Raises:
      ValueError: another form, or a size below 1.
    """
    sizes = {"tp": 1, "pp": 1}
    for part in text.split(","):
        axis, _, size = part.strip().partition("=")
        if axis not in sizes or not size.isdigit() or int(size) < 1:
            raise ValueError(f"mesh {text!r}: write tp=A,pp=B (sizes from 1), e.g. tp=2,pp=2")
        sizes[axis] = int(size)
    return sizes["tp"], sizes["pp"]
