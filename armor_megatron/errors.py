"""The project's root of input errors, each said in one line.

What a user gave (a config value, a file, a dataset row, a checkpoint, an engine's reply) is wrong,
and the message says what and where in one line.

Command-line tools turn a ``UserInputError`` into exit code 2 and that line. Every other exception
is a bug in this package (or in a library it calls) and keeps its traceback. Subclasses stay
``ValueError`` for callers that caught the older, looser type.
"""


class UserInputError(ValueError):
    """Input a user can fix; ``str(err)`` is one line naming the problem and where it is."""
