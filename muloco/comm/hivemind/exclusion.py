"""Why a member's contribution is left out of a group's mean: the reason's text, tagged with its kind by
the code that decides it (combine.py, transfer.py, auth.py, exchange.py)."""

from __future__ import annotations

# The kinds of exclusion. Only this peer's own non-finite contribution is the non-finite guard's business
# (sync/guard.py); the others are counted in summary.json by kind and never end a run: a peer at another
# step, a failed download or an insider's malformed payload is not divergence.
EXCLUSION_KINDS = (
    "other_step",  # the member is at another outer step
    "non_finite",  # non-finite values, or withheld by its sender as non-finite or unencodable
    "token_mismatch",  # downloaded bytes that do not hash to the token the member announced
    "truncated",  # a download still cut short after its attempts
    "download",  # a download that failed, timed out, or found nothing served
    "auth",  # a member without the swarm key, or not in allowed_peers
    "outlier",  # a norm beyond backend.hivemind.max_norm_ratio x the group's median
    "rule",  # a member combining by another sync.aggregate/trim
    "malformed",  # malformed metadata or payloads
)


class Exclusion(str):
    """Why a member's contribution was left out of a group's mean (the text logged and reported), tagged by
    the code that decides it with its kind (EXCLUSION_KINDS): counts by kind never depend on the wording."""

    kind: str

    def __new__(cls, kind: str, text: str) -> Exclusion:
        if kind not in EXCLUSION_KINDS:
            raise ValueError(f"unknown exclusion kind {kind!r}")
        reason = super().__new__(cls, text)
        reason.kind = kind
        return reason

    def __reduce__(self):  # copy and pickle keep the kind
        return (Exclusion, (self.kind, str(self)))


def exclusion_kind(reason: str) -> str:
    """The kind a reason was tagged with; an untagged text (none is produced here) counts as malformed."""
    return reason.kind if isinstance(reason, Exclusion) else "malformed"
