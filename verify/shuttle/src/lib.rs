//! Nothing here: the checks are in `tests/`, built with `--cfg shuttle`.
