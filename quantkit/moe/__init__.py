"""Mixture-of-Experts: per-expert linears (``experts``), the family layout (``layout``), calibration that
reaches every expert (``calibrate``), token statistics (``stats``) and serving facts (``serving``)."""
