"""Hydra configs for twinserve (a package so they ship with it and load by pkg://conf)."""
