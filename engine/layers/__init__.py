"""Model building blocks shared by every architecture in `engine/models/`."""

from __future__ import annotations

from torch import nn


class Layer(nn.Module):
    """A module whose call goes straight to `forward`, without nn.Module's hook dispatch.

    On CPU a decode step calls the decoder's modules about 300 times, and that dispatch
    (about 1.7 us a call on our 2-core VMs) was a fifth of the step's Python time. The
    model's own layers derive from this; forward hooks on them do not run."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward
