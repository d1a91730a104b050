"""`python -m services.trainer`: run the trainer service (batch.ready in, step.completed and weights.published out)."""

from services.trainer.service import TrainerService

if __name__ == "__main__":
    TrainerService.main()
