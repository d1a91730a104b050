"""`python -m services.harness`: run the harness service."""

from services.harness.service import HarnessService

if __name__ == "__main__":
    HarnessService.main()
