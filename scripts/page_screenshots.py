"""The screenshots of the page in docs/serving.md: a running server's chat (one question asked) and
dashboard, at desktop and phone widths, in a headless Chromium.

    picovllm serve --port 8000 &
    python scripts/page_screenshots.py http://127.0.0.1:8000 docs/
"""

import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

QUESTION = "Write a haiku about GPUs, then one line of Python that prints it."


def main(url: str, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,760"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path="/usr/bin/chromedriver"))
    try:
        driver.get(url + "/")
        driver.execute_script("localStorage.clear()")
        driver.get(url + "/")
        for name, value in (("temperature", "0"), ("max_tokens", "96")):
            box = driver.find_element(By.ID, name)
            box.clear()
            box.send_keys(value)
        driver.find_element(By.ID, "input").send_keys(QUESTION)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 300).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
        driver.save_screenshot(f"{out}/page_chat.png")
        driver.find_element(By.ID, "tab-dashboard").click()
        time.sleep(2.5)
        driver.save_screenshot(f"{out}/page_dashboard.png")
        driver.set_window_size(390, 844)
        driver.get(url + "/")  # (loaded narrow: the settings start folded)
        time.sleep(1)
        driver.save_screenshot(f"{out}/page_chat_phone.png")
    finally:
        driver.quit()


if __name__ == "__main__":
    main(*sys.argv[1:3])
