"""Math prompts and the answer reward for TRL's `GRPOTrainer`, by the rules `iha-eval` scores with.

`boxed_answer_reward` is 1.0 where a completion's final answer (the last `\\boxed{}`, read by
`iha.evaluation.answers.read_answer`) is math-verify equivalent to the row's `answer`, else 0.0: what pass@1 counts
as correct. `math_prompt_rows` turns GSM8K or MATH-500 rows into GRPO rows asked the way `iha-eval` asks them.
"""

from collections.abc import Sequence

from ..evaluation.answers import parse_answer, parsed_equivalent, read_answer
from ..evaluation.math_eval import DEFAULT_INSTRUCTION, load_problems


def completion_text(completion) -> str:
    """The text of one completion as TRL hands it to a reward: a string, or a list of messages (conversational)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion if message.get("role") == "assistant")


def boxed_answer_reward(completions: Sequence, answer: Sequence[str], **kwargs) -> list[float]:
    """GRPO reward: 1.0 per completion whose final answer equals the row's `answer` (math-verify), else 0.0."""
    golds = {gold: parse_answer(gold) for gold in set(answer)}
    return [
        float(parsed_equivalent(golds[gold], read_answer(completion_text(completion))[1]))
        for completion, gold in zip(completions, answer)
    ]


def math_prompt_rows(
    source: str,
    benchmark: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> list[dict]:
    """GRPO rows `{"prompt": [user turn], "answer": gold}` from GSM8K / MATH-500 (a name, Hub id or local file; see
    `iha.evaluation.math_eval.load_problems`), one user turn "question + instruction" as `iha-eval` asks it."""
    return [
        {
            "prompt": [
                {"role": "user", "content": f"{problem.question}\n{instruction}" if instruction else problem.question}
            ],
            "answer": problem.gold,
        }
        for problem in load_problems(source, benchmark=benchmark, split=split, limit=limit)
    ]
