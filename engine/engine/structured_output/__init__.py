"""Structured outputs: a request's output held to a JSON schema, regex, choice or grammar by
llguidance, with the token mask applied on the device by the sampler."""

from xlaserve.engine.structured_output.grammar import check_grammar, grammar_source
from xlaserve.engine.structured_output.manager import RequestGrammar, StructuredOutputManager

__all__ = ["RequestGrammar", "StructuredOutputManager", "check_grammar", "grammar_source"]
