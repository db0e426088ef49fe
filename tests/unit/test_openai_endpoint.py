"""The endpoint's refusals, through the real openai client over a real socket."""

from __future__ import annotations

import asyncio

import pytest

from areal.models.tiny import build_tokenizer
from areal.workflow.openai_endpoint import OpenAIEndpoint

openai = pytest.importorskip("openai")

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}


def refusal(call: str) -> openai.APIStatusError:
    async def body() -> openai.APIStatusError:
        endpoint = OpenAIEndpoint(
            build_tokenizer(), model="tiny", default_max_tokens=8, sampling=SAMPLING
        )
        await endpoint.start()
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key="not-a-session", max_retries=0
        )
        try:
            if call == "responses":
                await client.responses.create(model="tiny", input="1+1=")
            else:
                await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "1+1="}]
                )
        except openai.APIStatusError as e:
            return e
        finally:
            await client.close()
            await endpoint.close()
        raise AssertionError("the endpoint answered")

    return asyncio.run(body())


def test_the_responses_api_is_a_404_that_says_what_to_use():
    e = refusal("responses")
    assert e.status_code == 404
    assert "OpenAIChatCompletionsModel" in str(e) and "chat.completions" in str(e)


def test_a_call_without_a_session_token_is_a_401():
    e = refusal("chat")
    assert e.status_code == 401 and "unknown session" in str(e)
