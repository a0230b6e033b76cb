"""torchstruct: selective ``requires_grad`` and structural gradient trees for PyTorch.

Every public name is re-exported here from the one module that defines it:

- :mod:`.select`: selectors -> parameter sets;
- :mod:`.tree`: nested-dict trees (``ts.tree.map``, ``ts.tree.flatten``, ...);
- :mod:`.declare`: declarations and effective trainability (read-only);
- :mod:`.hooks`: ``attach``/``detach_hooks``, the hooks that write the flags;
- :mod:`._state`: the one owner of process-wide state (locked, owned by the live models);
- :mod:`.contexts`: ``freeze``, ``freeze_except``, ``unfreeze``;
- :mod:`.blocks`: block-local ``stop_gradient``, ``constant``, ``swap``;
- :mod:`.grad`: structural gradients; :mod:`.within`: ``within_gradient``;
- :mod:`.walk`: ``map_trainable``, ``polyak_update``;
- :mod:`.clip`: ``global_norm``, ``clip_by_global_norm``;
- :mod:`.groups`: ``param_groups``, ``layer_decay``;
- :mod:`.summary`: ``summary``; :mod:`.optim`: fused masked optimizers;
- :mod:`.schedule`: ``UnfreezeSchedule``; :mod:`.checkpoint`: ``state_dict``,
  ``load_state_dict`` (trainable-only checkpoints);
- :mod:`.distributed`: guards for DistributedDataParallel;
- :mod:`._ops`: the seam between the compiled extension and ``_reference.py``.
"""
from . import distributed, optim, tree
from ._ops import backend
from .blocks import *  # noqa: F401,F403
from .checkpoint import load_state_dict, state_dict
from .clip import *  # noqa: F401,F403
from .contexts import RestoredFlagsWarning, freeze, freeze_except, unfreeze
from .declare import is_trainable, mark_trainable, trainable_parameters
from .hooks import attach, detach_hooks
from .grad import *  # noqa: F401,F403
from .schedule import UnfreezeSchedule
from .groups import is_norm, layer_decay, param_groups
from .select import select
from .summary import summary
from .walk import *  # noqa: F401,F403
from .within import *  # noqa: F401,F403

__version__ = "0.1.0"
