"""The semantic answer cache at work: the service on the request path (service.py), the language a
question is written in (language.py) and the labelled traps its error bound is computed from
(calibration.py). Its decisions are in policy/answer_cache.py and policy/answer_bound.py."""
