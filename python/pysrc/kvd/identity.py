"""What names a model in kvd's layouts, for the engines the package integrates (vLLM's
connector, SGLang's backend): :func:`model_identity` (SPEC §3.1, "Model identity")."""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import kvd

logger = logging.getLogger(__name__)


def model_identity(model: str, revision: Optional[str] = None) -> str:
    """What names the model in kvd's layouts (SPEC §3.1, "Model identity"): the digest of
    the checkpoint's config and weights (:func:`kvd.model_identity`), wherever it sits.

    ``model`` is a local directory (or weight file), or a hub name whose snapshot is in
    the local cache (vLLM downloaded it there). When neither gives files to digest, the
    name itself (with its revision) is the identity, and a warning says why: engines
    then share blocks only under the same name, and weights replaced under that name
    are not noticed (set ``model_id``).
    """
    path = model
    if not os.path.exists(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(model, revision=revision, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means: no local snapshot
            logger.warning("kvd: no local files for model %r (%s); naming it by that name: set model_id to be exact", model, e)
            return f"{model}@{revision}" if revision else model
    t0 = time.monotonic()
    try:
        ident = kvd.model_identity(path)
    except OSError as e:
        logger.warning("kvd: cannot digest the weights of model %r (%s); naming it by that name: set model_id to be exact", model, e)
        return f"{model}@{revision}" if revision else model
    logger.info("kvd: model %s is %s (its config and weights, digested in %.0f ms)", model, ident, (time.monotonic() - t0) * 1e3)
    return ident
