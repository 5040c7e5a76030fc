"""Analysis over the evaluation database: the only place statistics across
evaluations are computed, always through :mod:`mlscope.stats`."""
