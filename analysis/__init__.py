"""Analysis over the evaluation database (issue 7): the only place statistics across
evaluations are computed, always through :mod:`mlscope.stats`."""
