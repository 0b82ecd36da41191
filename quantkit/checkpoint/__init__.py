"""Checkpoint folders: the one writer (``save``, ``writer``), the one reader (``read``), the settings and
layouts other tools write (``settings``, ``layouts``, ``quant_config``), ``inspect`` and the serving engines'
kernel per checkpoint (``engines``). File and tensor names shared by all of them live in ``format``."""
