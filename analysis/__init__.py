"""Analysis over the evaluation database: the only place statistics across
evaluations are defined, with :mod:`mlscope.stats`' definitions, computed by the
database where it can (:mod:`analysis.sqlstats`)."""
