"""Structured output: constraining a request's tokens to a JSON schema, regex, choice or grammar.

``params`` says what a request asks for, ``json_schema`` which schema keywords are enforced,
``compiler`` compiles constraints with xgrammar (cached, off the engine thread) and ``matcher``
keeps each sequence's place in its grammar and fills the step's token masks.
"""
