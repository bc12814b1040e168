"""The base of every request body the gateway reads."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    """A JSON body: strict types (no "5" for 5); unknown fields are kept aside (model_extra) and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
