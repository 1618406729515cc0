"""Which weights the engine in this process serves: the part of a plugin's
page identity that follows the weights (docs/plugins/sglang.md and
docs/plugins/lmcache.md, "Page identity and the weights").

Two engines that give their model one name but load other weights (a
fine-tune saved under the base model's name, a re-upload, another
revision) compute other KV for the same tokens; their pages must miss each
other. So a plugin's identity holds a fingerprint of the weights
(:func:`kvcellar.fingerprint.weights_fingerprint`), found from what the
engine says it loads, plus the quantization it applies when loading and
its config overrides, where the engine tells them. The option
``model_fingerprint`` replaces the computed fingerprint.

The engines' own records are read, never imported here: only a module the
engine has already loaded is looked at, so this imports without torch or
any engine.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, Optional, Tuple

from kvcellar.config import ConfigError
from kvcellar.fingerprint import FingerprintError, weights_fingerprint

#: What the identity takes from an engine's record of its model.
FIELDS = ("model", "revision", "load_format", "download_dir", "quantization", "overrides")


def _value(v: Any) -> Any:
    """An enum's value, else the thing itself."""
    return getattr(v, "value", v)


def _overrides(v: Any) -> Optional[str]:
    """Config overrides in one canonical form (None when there are none)."""
    if v is None:
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else None
        except ValueError:
            return v
    if not v:
        return None
    return json.dumps(v, sort_keys=True, default=str)


def sglang_model() -> Optional[Dict[str, Any]]:
    """SGLang's record of the model it serves in this process (its
    scheduler publishes it in ``sglang.srt.runtime_context``: the resolved
    model namespace, else the raw server arguments), or None outside a
    launched SGLang server."""
    rc = sys.modules.get("sglang.srt.runtime_context")
    if rc is None:
        return None
    for getter in ("get_model", "get_server_args"):
        try:
            src = getattr(rc, getter)()
        except Exception:  # noqa: BLE001 - not published in this process
            continue
        path = getattr(src, "model_path", None)
        if path:
            return {
                "model": str(path),
                "revision": getattr(src, "revision", None),
                "load_format": _value(getattr(src, "load_format", None)),
                "download_dir": getattr(src, "download_dir", None),
                "quantization": _value(getattr(src, "quantization", None)),
                "overrides": _overrides(getattr(src, "json_model_override_args", None)),
            }
    return None


def vllm_model() -> Optional[Dict[str, Any]]:
    """vLLM's record of the model it serves, when vLLM is building this
    worker (``vllm.config``'s current config, set while vLLM creates its KV
    connector and with it LMCache's), or None."""
    cfg = sys.modules.get("vllm.config")
    get = getattr(cfg, "get_current_vllm_config_or_none", None)
    try:
        vc = get() if get is not None else None
    except Exception:  # noqa: BLE001
        vc = None
    mc = getattr(vc, "model_config", None)
    if mc is None or not getattr(mc, "model", None):
        return None
    lc = getattr(vc, "load_config", None)
    return {
        "model": str(mc.model),
        "revision": getattr(mc, "revision", None),
        "load_format": _value(getattr(lc, "load_format", None)),
        "download_dir": getattr(lc, "download_dir", None),
        "quantization": _value(getattr(mc, "quantization", None)),
        "overrides": _overrides(getattr(mc, "hf_overrides", None)),
    }


def weights_identity(fingerprint: Any, served: Optional[Dict[str, Any]], where: str,
                     key: str = "model_fingerprint") -> Tuple[Dict[str, str], str]:
    """The identity entries that follow the weights, and a line saying
    where they came from (for the plugin's ready line).

    ``fingerprint``: the ``model_fingerprint`` option (None: compute it);
    ``served``: the engine's record (:data:`FIELDS`; ``model`` at least),
    None when the engine gave none. Quantization and overrides enter when
    the record has them, whichever way the weights are named."""
    ident: Dict[str, str] = {}
    if fingerprint is not None:
        if not isinstance(fingerprint, str) or not fingerprint.strip():
            raise ConfigError(f"{where} key '{key}': {fingerprint!r} must be text naming the weights "
                              "(the same on every instance that serves them)")
        ident["weights"] = fingerprint.strip()
        source = f"{key} {fingerprint.strip()!r}"
    elif served is None:
        raise ConfigError(f"{where}: the engine did not tell which weights it serves, so pages cannot be told "
                          f"apart from another model's of the same name: set '{key}' (any text naming these "
                          "weights, the same on every instance that serves them)")
    else:
        try:
            ident["weights"] = weights_fingerprint(served["model"], served.get("revision"),
                                                   served.get("load_format"), served.get("download_dir"))
        except FingerprintError as e:
            raise FingerprintError(f"{where}: {e}") from None
        rev = served.get("revision")
        source = f"{served['model']}{'@' + str(rev) if rev else ''}"
    if served is not None and "quantization" in served:
        ident["quantization"] = str(served["quantization"])
    if served is not None and served.get("overrides"):
        ident["overrides"] = str(served["overrides"])
    return ident, f"weights {ident['weights']} ({source})"


__all__ = ["FIELDS", "sglang_model", "vllm_model", "weights_identity"]
