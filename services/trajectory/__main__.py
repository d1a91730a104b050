"""`python -m services.trajectory`: run the trajectory service."""

from services.trajectory.service import TrajectoryService

if __name__ == "__main__":
    TrajectoryService.main()
