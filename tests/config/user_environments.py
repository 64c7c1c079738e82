"""Environments ``rollout.environment.spec`` names in the check tests (``tests.config.user_environments:...``)."""


class Calculator:
    """The docs' smallest environment: answers ``calc a+b`` with the sum, done at any other turn."""

    def __init__(self, row):
        self.row = row

    def step(self, response):
        if not response.startswith("calc "):
            return None
        a, b = response[5:].split("+")
        return f" = {int(a) + int(b)}\n"


class NeedsExpression(Calculator):
    """Built from a column the rows lack: the constructor's KeyError names it."""

    def __init__(self, row):
        super().__init__(row)
        self.expression = row["expression"]


class StepRaises(Calculator):
    """Steps by parsing the response as a number, which a stated answer is not."""

    def step(self, response):
        return str(float(response))
