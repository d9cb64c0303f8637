"""What ``--dry-run`` shows of the optimizer state a conversion carries, per destination file.

The same decision as ``convert`` (``carry.carried_optimizer``: carried, or a notice, refused under --strict);
the destination's saver lists the files and sizes (``Saver.plan_optimizer``) with its writers' own
derivations, without writing: e.g. a Megatron per-rank rank file's ``optimizer`` entry or ``distrib_optim.pt``,
a torch_dist records file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pgconvert.optimizer.carry import plan_optimizer

if TYPE_CHECKING:
    from pgconvert.run.convert import Plan


def plan_lines(conversion: Plan) -> list[str]:
    """``--dry-run``'s optimizer lines: each destination file's optimizer state and a total, or the notices of
    state that is not carried (nothing when the conversion has no optimizer state to carry)."""
    files, notices = plan_optimizer(conversion)
    lines = [f"  {item.relpath}  + {item.what}  {item.tensors} tensors  {item.nbytes} bytes" for item in files]
    if files:
        lines.append(f"optimizer: {len(files)} files, {sum(item.tensors for item in files)} tensors, "
                     f"{sum(item.nbytes for item in files)} bytes")
    return lines + [f"optimizer: {notice}" for notice in notices]
