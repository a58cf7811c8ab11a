"""A model's random regularization, and a scope that turns it off for the correctness check.

The bench trains models as users train them: dropout, attention dropout and stochastic depth stay at the
model's own defaults in the timed steps. Values are checked in a separate pass with every such probability
set to 0 (``no_random``), so that the check against eager compares deterministic numbers. Eval mode is no
substitute: it changes BatchNorm too.

A *site* is one probability a module reads when it draws a random mask:

- ``p`` of ``nn.Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``, ``FeatureAlphaDropout`` (every
  ``torch.nn.modules.dropout._DropoutNd``), and of any module whose class name contains "Drop" or
  "StochasticDepth" (torchvision's ``StochasticDepth``);
- every float attribute in ``[0, 1)`` whose name contains "drop": timm's ``DropPath.drop_prob``, the
  ``attention_dropout`` / ``dropout`` / ``dropout_p`` / ``hidden_dropout`` / ``layerdrop`` floats that
  HuggingFace attention and layer modules pass to functional dropout or SDPA, ``nn.MultiheadAttention.dropout``;
- the same float attributes of an HF ``config`` a module holds (a few models read them at run time).

A random op the bench cannot see (a probability under another name, a bare ``torch.rand``) is caught by
the runner instead, which runs eager's check twice and refuses to compare when the two runs differ.
"""
from __future__ import annotations

import contextlib

import torch


class RandomOpsLeftError(RuntimeError):
    """``no_random`` set every dropout probability it found to 0, but some still read nonzero afterwards
    (a property that ignores assignment, or a site restored by the model itself): the check would compare
    random draws. The message lists the sites; make them settable or leave the case out of the zoo."""


def _is_prob(name: str, value) -> bool:
    return isinstance(value, float) and "drop" in name.lower() and 0.0 <= value < 1.0


def _has_p(module) -> bool:
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return True
    names = [c.__name__.lower() for c in type(module).__mro__]
    return any("drop" in n or "stochasticdepth" in n for n in names)


def _config_of(module):
    cfg = vars(module).get("config")
    return cfg if cfg is not None and not isinstance(cfg, (torch.nn.Module, torch.Tensor, dict)) \
        and hasattr(cfg, "__dict__") else None


def random_sites(model) -> list:
    """``[(owner, attribute, value, where)]``: every nonzero dropout probability of ``model`` (see the
    module docstring); ``where`` names the module path and attribute. Empty for a plain function."""
    if not isinstance(model, torch.nn.Module):
        return []
    out, seen = [], set()
    for path, m in model.named_modules():
        owners = [(m, path or type(m).__name__)]
        cfg = _config_of(m)
        if cfg is not None:
            owners.append((cfg, f"{path or type(m).__name__}.config"))
        for owner, where in owners:
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            for name, value in list(vars(owner).items()):
                if _is_prob(name, value) and value > 0:
                    out.append((owner, name, value, f"{where}.{name}"))
            p = vars(owner).get("p")
            if owner is m and _has_p(m) and isinstance(p, float) and 0.0 < p < 1.0:
                out.append((m, "p", p, f"{where}.p"))
    return out


@contextlib.contextmanager
def no_random(model):
    """Within the scope every dropout probability of ``model`` (``random_sites``) is 0; on exit each is
    restored to its value, also when the scope raises. Yields the number of sites turned off.

    Raises ``RandomOpsLeftError`` when a site still reads nonzero after it was set to 0. A compiled
    function traced inside the scope has the probabilities baked in: recompile (``torch._dynamo.reset``)
    before timing steps with them back on."""
    sites = random_sites(model)
    done = []
    try:
        for owner, name, value, _ in sites:
            setattr(owner, name, 0.0)
            done.append((owner, name, value))
        left = random_sites(model)
        if left:
            raise RandomOpsLeftError(f"dropout still on after no_random: {[w for *_, w in left][:8]}; "
                                     f"those probabilities ignore assignment")
        yield len(sites)
    finally:
        for owner, name, value in reversed(done):
            setattr(owner, name, value)
