"""The page at / (chat playground, dashboard) in a headless Chromium, against the server on the
tiny model: a streamed reply equal to the API's greedy answer, its TTFT and tok/s, the dashboard's
counters moving, a wrong API key shown as an error, screenshots at desktop and phone widths
(saved under $PICOVLLM_TEST_ARTIFACTS, default a temporary folder, and checked not blank).
Needs Debian's chromium and chromium-driver (`apt-get install chromium chromium-driver`)."""

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import make_llm

webdriver = pytest.importorskip("selenium.webdriver", reason="the page tests need selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("no browser: apt-get install chromium chromium-driver", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from picovllm.entrypoints.openai.async_engine import AsyncEngine  # noqa: E402
from picovllm.entrypoints.openai.server import build_app, serve_in_thread  # noqa: E402

KEY = "sk-page"
QUESTION = "Name three colours."


@pytest.fixture(scope="module")
def servers(tiny_qwen):
    """(URL without a key, URL with --api-key KEY)."""
    made = []
    for key in (None, KEY):
        engine = AsyncEngine(make_llm(tiny_qwen[0], max_model_len=256).llm_engine)
        url, stop = serve_in_thread(build_app(engine, "tiny", api_key=key))
        made.append((url, stop, engine))
    yield made[0][0], made[1][0]
    for _, stop, engine in made:
        stop()
        engine.shutdown()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


def _artifacts() -> Path:
    path = Path(os.environ.get("PICOVLLM_TEST_ARTIFACTS") or os.environ.get("TMPDIR", "/tmp")) / "picovllm-page"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _screenshot(driver, name: str) -> Path:
    """Save the page as PNG and check it is not blank (many distinct colours in it)."""
    from PIL import Image

    path = _artifacts() / f"{name}.png"
    driver.save_screenshot(str(path))
    image = Image.open(path).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert image.width > 300 and len(colours) > 20, f"{path} looks blank"
    return path


def _wait(driver, condition, timeout=60):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d))


def _open(driver, url: str, key: str = "") -> None:
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")
    _wait(driver, lambda d: d.find_element(By.ID, "send").is_displayed())
    field = driver.find_element(By.ID, "api_key")
    field.clear()
    field.send_keys(key)
    for name, value in (("temperature", "0"), ("max_tokens", "24")):
        box = driver.find_element(By.ID, name)
        box.clear()
        box.send_keys(value)
    driver.execute_script("document.getElementById('api_key').dispatchEvent(new Event('change'))")


def _send(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def _stored(driver) -> list[dict]:
    return driver.execute_script("return JSON.parse(localStorage.getItem('picovllm.chat'))") or []


def _counter(driver, key: str) -> float:
    # One script reads the card: the dashboard redraws its cards each poll, so an element
    # found in one call may be gone (stale) by the next.
    text = driver.execute_script(
        "return document.querySelector(arguments[0]).innerText", f".card[data-key={key}] .value"
    )
    return float(text.replace("–", "nan"))


def test_chat_streams_the_apis_greedy_answer_and_shows_its_speed(servers, browser):
    url = servers[0]
    want = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 24},
        timeout=60,
    ).json()["choices"][0]["message"]["content"]
    _open(browser, url)
    _wait(browser, lambda d: d.find_element(By.ID, "model").text == "tiny")
    _send(browser, QUESTION)
    stats = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))[0]
    assert re.fullmatch(r"TTFT \d+ ms · [\d.]+ tok/s · 24 tokens( · .*)?", stats.text), stats.text
    assert float(re.search(r"([\d.]+) tok/s", stats.text).group(1)) > 0
    messages = _stored(browser)
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"] == want
    assert not browser.find_element(By.ID, "error").is_displayed()
    _screenshot(browser, "chat-desktop")
    # the same question again: the prompt's blocks come from the prefix cache
    browser.find_element(By.ID, "regenerate").click()
    _wait(browser, lambda d: "prefix cache" in d.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text)
    assert _stored(browser)[1]["content"] == want  # (greedy: the same answer)


def test_the_dashboard_counters_move(servers, browser):
    url = servers[0]
    _open(browser, url)
    browser.find_element(By.ID, "tab-dashboard").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".card[data-key=tokens]"))
    before = _counter(browser, "tokens"), _counter(browser, "requests")
    httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 7}, timeout=60)
    _wait(browser, lambda d: _counter(d, "requests") == before[1] + 1)
    assert _counter(browser, "tokens") == before[0] + 7
    host = browser.execute_script("return document.querySelector('.card[data-key=host] .value').innerText")
    assert host == "off"
    assert len(browser.find_elements(By.CSS_SELECTOR, ".chart canvas")) == 4
    _screenshot(browser, "dashboard-desktop")
    browser.set_window_size(390, 844)  # a phone
    try:
        _screenshot(browser, "dashboard-phone")
        browser.find_element(By.ID, "tab-chat").click()
        _send(browser, QUESTION)
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
        composer = browser.find_element(By.ID, "composer").rect
        assert composer["x"] >= 0 and composer["x"] + composer["width"] <= 390  # (nothing off the screen)
        _screenshot(browser, "chat-phone")
    finally:
        browser.set_window_size(1280, 860)


def test_a_wrong_api_key_is_shown_and_the_right_one_works(servers, browser):
    url = servers[1]
    _open(browser, url, key="sk-wrong")
    error = _wait(browser, lambda d: d.find_element(By.ID, "error") if d.find_element(By.ID, "error").text else None)
    assert "API key" in error.text
    _send(browser, QUESTION)
    failed = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant.failed .stats"))[0]
    assert "Wrong or missing API key" in failed.text
    _open(browser, url, key=KEY)
    _send(browser, QUESTION)
    stats = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))[0]
    assert stats.text.startswith("TTFT") and not browser.find_element(By.ID, "error").is_displayed()


def test_disable_web_ui_leaves_the_api(tiny_qwen):
    engine = AsyncEngine(make_llm(tiny_qwen[0]).llm_engine)
    url, stop = serve_in_thread(build_app(engine, "tiny", web_ui=False))
    try:
        assert httpx.get(url + "/").status_code == 404 and httpx.get(url + "/static/app.js").status_code == 404
        stats = httpx.get(url + "/stats").json()
        assert stats["model"] == "tiny" and stats["now"]["requests"] == 0
    finally:
        stop()
        engine.shutdown()


def test_markdown_is_rendered_from_escaped_text(servers, browser):
    _open(browser, servers[0])
    html = browser.execute_script(
        "return markdown(arguments[0])",
        "# Title\nSome **bold** and `code`.\n\n- one\n- two\n\n```python\nprint('<b>')\n```\n<script>alert(1)</script>",
    )
    assert "<h3>Title</h3>" in html and "<strong>bold</strong>" in html and "<code>code</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert "<pre><code>print('&lt;b&gt;')</code></pre>" in html
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def _fill(driver, field: str, text: str) -> None:
    box = driver.find_element(By.ID, field)
    box.clear()
    box.send_keys(text)


def test_a_json_schema_shapes_the_answer_and_tool_calls_show_as_calls(servers, browser):
    import jsonschema

    url = servers[0]
    schema = {"type": "object", "properties": {"tag": {"enum": ["red", "blue"]}}, "required": ["tag"]}
    _open(browser, url)
    _fill(browser, "max_tokens", "80")
    _fill(browser, "json_schema", "{not json")
    _send(browser, QUESTION)
    error = _wait(browser, lambda d: d.find_element(By.ID, "error") if d.find_element(By.ID, "error").text else None)
    assert "The JSON schema is not JSON" in error.text
    _fill(browser, "json_schema", json.dumps(schema))
    browser.find_element(By.ID, "regenerate").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
    jsonschema.validate(json.loads(_stored(browser)[-1]["content"]), schema)
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    _fill(browser, "json_schema", "")
    _fill(browser, "tools", json.dumps([tool]))
    Select(browser.find_element(By.ID, "tool_choice")).select_by_visible_text("required")
    browser.find_element(By.ID, "regenerate").click()
    call = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .tool-call"))[0]
    assert call.text.startswith("tool call: pick({")
    (stored,) = _stored(browser)[-1]["tool_calls"]
    jsonschema.validate(json.loads(stored["function"]["arguments"]), schema)
    _screenshot(browser, "chat-tool-call")
    _fill(browser, "tools", "")
